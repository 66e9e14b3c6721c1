"""What a profile was measured on: this machine (`machine_tag`) and the code it timed (`code_fingerprint`, over the
executors and the decoder, `CODE_PACKAGES`). A profile of other code prices that code: its users compare the
fingerprint and re-measure or warn (`dblock simulate validate`, the demo)."""
from __future__ import annotations

import os
import platform


def machine_tag() -> str:
    return f"{platform.system()}-{platform.machine()}-{os.cpu_count()}cpu"


#: the packages whose code a profile times: a change there (an executor made faster) makes a profile stale
CODE_PACKAGES = ("reference", "optimized", "decoding", "kernels")
#: and the measuring method whose change makes the old tables wrong (the Epoch MoE table from real decode passes)
METHOD_FILES = ("profiling/profiler_epoch.py",)


def code_fingerprint() -> str:
    """SHA-256 (16 hex digits) of the source of the executors and the decoder (`CODE_PACKAGES`), stored in every
    profile's meta as `code`: a profile measured before a change to them prices the old code."""
    import hashlib
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for pkg in CODE_PACKAGES:
        d = os.path.join(root, pkg)
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            if name.endswith(".py"):
                h.update(f"{pkg}/{name}\0".encode())
                with open(os.path.join(d, name), "rb") as f:
                    h.update(f.read())
    for name in METHOD_FILES:
        with open(os.path.join(root, name), "rb") as f:
            h.update(f"{name}\0".encode())
            h.update(f.read())
    return h.hexdigest()[:16]
