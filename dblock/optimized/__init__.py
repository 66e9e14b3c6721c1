"""The optimized (Epoch) executor (docs/algorithms.md §4). Importing the package registers every family's Epoch
executor class in `executor.EPOCH_CLASSES` (the DiffusionGemma one lives in `gemma_epoch`)."""
from dblock.optimized import gemma_epoch  # noqa: F401  (registers GemmaEpochExecutor)
