"""dblock: block-diffusion mixture-of-experts language models, fast and provably right.

    import dblock
    model = dblock.load("tiny-masked")                     # or a local HF folder
    res = dblock.generate(model, [[5, 6, 7]], dblock.DecodeConfig(max_new_tokens=64))
    res.tokens, res.summary()
"""
from dblock.config import ModelConfig, load_config
from dblock.decoding.params import DecodeConfig
from dblock.errors import ConfigError, WeightsError


def __getattr__(name):
    """`load` and `save` import torch: loaded on first use, so `import dblock` (and `dblock --help`) stays light."""
    if name == "load":
        from dblock.weights import load
        return load
    if name == "save":
        from dblock.weights_write import save
        return save
    raise AttributeError(f"module 'dblock' has no attribute {name!r}")


def generate(*args, **kwargs):
    """See `dblock.decoding.generate.generate`."""
    from dblock.decoding.generate import generate as _generate
    return _generate(*args, **kwargs)


__all__ = ["load", "save", "generate", "load_config", "DecodeConfig", "ModelConfig", "ConfigError", "WeightsError"]
__version__ = "0.1.0"
