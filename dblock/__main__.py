"""`python -m dblock ...` (and `torchrun ... -m dblock ...`) = the `dblock` command."""
import sys

from dblock.cli import main

sys.exit(main())
