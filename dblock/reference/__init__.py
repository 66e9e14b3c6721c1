"""The readable dense executors (docs/algorithms.md §1), nanoGPT-style: the models of both LLaDA families
(`llada.py`) and DiffusionGemma (`gemma.py`), their batched Forward with the exact prefix KV cache (`executor.py`,
`gemma_executor.py`), their HF weight tables (`llada_weights.py`, `gemma_weights.py`, over `slots.py`) and tiny
presets (`llada_tiny.py`, `gemma_tiny.py`). The ground truth the optimized executor is checked against: no Triton,
no torch.distributed, no caching tricks. It imports only configuration (dblock/config.py, dblock/gemma_config.py),
the Forward protocol and the errors."""
