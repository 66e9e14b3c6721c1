"""The family registry: one entry per family, consistent with the config-only readers; reading a config needs no
torch and no model."""
import os
import subprocess
import sys

import pytest

from dblock.config import CONFIG_READERS
from dblock.decoding.generate import reference_forward
from dblock.families import FAMILIES, family
from dblock.reference.executor import LladaReference
from dblock.reference.gemma_executor import GemmaReference
from dblock.tiny import make_tiny_model, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_registry_matches_config_readers():
    assert list(FAMILIES) == list(CONFIG_READERS) == ["llada2_moe", "llada_moe", "diffusion_gemma"]
    for name, fam in FAMILIES.items():
        assert fam.name == name and fam.read_config is CONFIG_READERS[name]
        cfg = fam.tiny_config()
        assert isinstance(cfg, fam.config_class) and cfg.family == name
        assert fam.read_config(cfg.to_hf_dict(), "x/config.json").to_hf_dict() == cfg.to_hf_dict()


@pytest.mark.parametrize("name,executor", [("llada2_moe", LladaReference), ("llada_moe", LladaReference),
                                           ("diffusion_gemma", GemmaReference)])
def test_tiny_model_and_reference_forward(name, executor):
    m = make_tiny_model(name, seed=0)
    assert isinstance(m, FAMILIES[name].model_class) and m.config == tiny_config(name)
    assert type(reference_forward(m)) is executor


def test_unknown_family():
    with pytest.raises(ValueError, match="family='mystery': allowed llada2_moe, llada_moe, diffusion_gemma"):
        make_tiny_model("mystery")
    with pytest.raises(ValueError, match="family='mystery'"):
        family("mystery")


def test_reading_a_config_imports_no_torch():
    """dblock.config (and the DiffusionGemma config it reads) import neither torch nor a model. The package's own
    __init__ is bypassed: this checks the config modules themselves."""
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('dblock'); pkg.__path__ = [{os.path.join(ROOT, 'dblock')!r}]\n"
        "sys.modules['dblock'] = pkg\n"
        "from dblock.config import load_config\n"
        f"cfg = load_config({os.path.join(ROOT, 'dblock', 'checkpoints', 'tiny-uniform')!r})\n"
        "assert cfg.family == 'diffusion_gemma', cfg.family\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'safetensors')))\n"
        "assert not bad, bad\n"
        "assert not any(m in sys.modules for m in ('dblock.reference.gemma', 'dblock.weights', 'dblock.families'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
