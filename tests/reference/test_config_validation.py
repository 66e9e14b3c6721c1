"""Model-config validation (dblock/validate.py, used by dblock/config.py and dblock/gemma_config.py):
every bad value is one ConfigError naming the file and the key; implausibly large models are refused before
anything is built; every real and test config stays valid."""
import glob
import json
import math
import os
import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dblock import validate
from dblock.config import ConfigError, LLADA2_KEYS, LLADA_MOE_KEYS, llada_config_from_dict, load_config
from dblock.families import FAMILIES
from dblock.gemma_config import (FULL, GEMMA_TEXT_KEYS, SLIDING, TINY_VISION, GemmaConfig,
                                          default_rope_parameters)
from dblock.tiny import tiny_config
from tests.reference.gemma_util import TINY_CONFIGS
from tests.reference.test_config import LLADA_MOE, MINI

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAN, INF = float("nan"), float("inf")


def _slot_counts(cfg):
    """(parameters the model holds, tensors in the checkpoint), summed over the family's slot table."""
    slots = FAMILIES[cfg.family].slots(cfg)
    return sum(math.prod(s.shape) for s in slots.values() if not s.copy), len(slots)


def _tensors(cfg):
    fn = validate.gemma_tensors if cfg.family == "diffusion_gemma" else validate.llada_tensors
    return fn(cfg.sizes())


def _write(folder, d):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "config.json")
    with open(path, "w") as f:
        f.write(d if isinstance(d, str) else json.dumps(d))
    return path


# ---------------------------------------------------------------------------------------------------------------
# what must stay valid
# ---------------------------------------------------------------------------------------------------------------

def test_bundled_checkpoints_are_valid_and_counted_exactly():
    paths = sorted(glob.glob(os.path.join(ROOT, "dblock", "checkpoints", "*", "config.json")))
    assert paths
    for p in paths:
        cfg = load_config(p)
        assert (cfg.param_count(), _tensors(cfg)) == _slot_counts(cfg), p


@pytest.mark.parametrize("family, over", [
    ("llada2_moe", {}), ("llada_moe", {}), ("diffusion_gemma", {}),
    *[("diffusion_gemma", o) for o in TINY_CONFIGS.values()],
    ("diffusion_gemma", {"tie_word_embeddings": False}),
])
def test_tiny_presets_valid_and_counted_exactly(family, over):
    cfg = tiny_config(family, **over)
    assert (cfg.param_count(), _tensors(cfg)) == _slot_counts(cfg)
    if family == "diffusion_gemma":   # and through config.json
        assert GemmaConfig.from_hf_dict(cfg.to_hf_dict(), "x/config.json") == cfg


def test_real_llada_configs_valid():
    assert llada_config_from_dict(MINI).param_count() > 1.5e10   # LLaDA2.0-mini: 16B
    assert llada_config_from_dict(LLADA_MOE).num_experts == 64
    # null means the default for optional keys, as HF configs write them
    c = llada_config_from_dict({**MINI, "head_dim": None, "num_key_value_heads": None, "n_group": None,
                                "topk_group": None, "rope_theta": None, "moe_router_enable_expert_bias": None})
    assert (c.head_dim, c.num_key_value_heads, c.n_group, c.rope_theta, c.use_expert_bias) == (128, 16, 1, 1e4, True)


def test_train_tiny_configs_valid():
    from dblock.tasks.train_config import LLADA2_SIZES, llada2_config
    from dblock.tasks.train_uniform import GEMMA_SIZES, gemma_config
    for size in LLADA2_SIZES:
        llada2_config(size)
    for size in GEMMA_SIZES:
        gemma_config(size)


def test_transformers_diffusion_gemma_configs_valid():
    pytest.importorskip("transformers")
    from transformers import DiffusionGemmaConfig
    d = DiffusionGemmaConfig().to_dict()
    d["text_config"].update(num_experts=128, top_k_experts=8, moe_intermediate_size=704)
    cfg = GemmaConfig.from_hf_dict(d, "x/config.json")
    assert cfg.num_hidden_layers == 30 and cfg.global_head_dim == 512
    assert (cfg.param_count(), _tensors(cfg)) == _slot_counts(cfg)


# ---------------------------------------------------------------------------------------------------------------
# typed, finite, in range: one ConfigError naming file and key
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, needle", [
    ("block_size", 8.5, "unsupported block_size=8.5 (allowed: a positive integer or null; got a number)"),
    ("block_size", 8.0, "unsupported block_size=8.0"),
    ("block_size", "32", "unsupported block_size='32' (allowed: a positive integer or null; got a string)"),
    ("num_hidden_layers", True, "unsupported num_hidden_layers=True (allowed: a positive integer; got a boolean)"),
    ("num_hidden_layers", 0, "unsupported num_hidden_layers=0 (allowed: a positive integer)"),
    ("hidden_size", None, "unsupported hidden_size=None (allowed: a positive integer; got null)"),
    ("num_experts", [256], "unsupported num_experts=[256]"),
    ("head_dim", 0, "unsupported head_dim=0"),
    ("num_key_value_heads", 0, "unsupported num_key_value_heads=0"),
    ("n_group", 0, "unsupported n_group=0"),
    ("first_k_dense_replace", -1, "unsupported first_k_dense_replace=-1 (allowed: a non-negative integer"),
    ("rope_theta", NAN, "unsupported rope_theta=nan (allowed: a finite number > 0"),
    ("rope_theta", INF, "unsupported rope_theta=inf"),
    ("rope_theta", "1e4", "unsupported rope_theta='1e4'"),
    ("rms_norm_eps", 0, "unsupported rms_norm_eps=0 (allowed: a finite number in (0, 1]"),
    ("rms_norm_eps", -1e-6, "unsupported rms_norm_eps=-1e-06"),
    ("routed_scaling_factor", -INF, "unsupported routed_scaling_factor=-inf"),
    ("partial_rotary_factor", 0.0, "unsupported partial_rotary_factor=0.0 (allowed: a finite number in (0, 1]"),
    ("partial_rotary_factor", 2.0, "unsupported partial_rotary_factor=2.0"),
    ("use_qk_norm", "false", "unsupported use_qk_norm='false' (allowed: true or false or null; got a string)"),
    ("moe_router_enable_expert_bias", 1, "unsupported moe_router_enable_expert_bias=1"),
    ("eos_token_id", "156892", "unsupported eos_token_id='156892'"),
    ("pad_token_id", -1, "unsupported pad_token_id=-1"),
    ("eos_token_id", [], "unsupported eos_token_id=[]"),
    ("rope_scaling", "linear", "unsupported rope_scaling='linear' (allowed: an object or null; got a string)"),
])
def test_llada_bad_values_named(tmp_path, key, value, needle):
    path = _write(str(tmp_path), {**MINI, key: value})
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path))
    assert str(e.value).startswith(path + ": ") and needle in str(e.value), str(e.value)


@pytest.mark.parametrize("patch, needle", [
    ({"num_attention_heads": 3, "num_key_value_heads": 1}, "num_attention_heads=3 (allowed: a divisor of "
                                                           "hidden_size=2048)"),
    ({"head_dim": None, "num_attention_heads": 3, "num_key_value_heads": 1}, "num_attention_heads=3"),
    ({"block_size": 65536}, "block_size=65536 (allowed: <= max_position_embeddings=32768)"),
    ({"n_group": 7}, "n_group=7"),
    ({"topk_group": 9}, "topk_group=9"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok=300"),
])
def test_llada_cross_field_named(patch, needle):
    with pytest.raises(ConfigError, match=re.escape("unsupported " + needle)):
        llada_config_from_dict({**MINI, **patch})


def test_llada_moe_keys_named():
    for key, value in (("expert_intermediate_size", 0), ("expert_intermediate_size", 1024.5),
                       ("dense_intermediate_size", -1), ("qk_layernorm", "yes")):
        with pytest.raises(ConfigError, match=f"unsupported {key}="):
            llada_config_from_dict({**LLADA_MOE, key: value})


def test_code_built_configs_checked_too():
    for over, key in (({"block_size": 8.5}, "block_size"), ({"num_experts": True}, "num_experts"),
                      ({"rope_theta": NAN}, "rope_theta"), ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
                      ({"use_qk_norm": 1}, "use_qk_norm"), ({"max_position_embeddings": 4}, "block_size")):
        with pytest.raises(ConfigError, match=f"tiny llada2_moe config: unsupported {key}="):
            tiny_config("llada2_moe", **over)
    for over, key in (({"canvas_length": 16.0}, "canvas_length"), ({"final_logit_softcapping": INF},
                                                                    "final_logit_softcapping"),
                      ({"eos_token_ids": (True,)}, "eos_token_ids"), ({"tie_word_embeddings": "no"},
                                                                       "tie_word_embeddings"),
                      ({"num_attention_heads": 3, "num_key_value_heads": 1, "num_global_key_value_heads": 1},
                       "num_attention_heads")):
        with pytest.raises(ConfigError, match=f"tiny diffusion_gemma config: unsupported {key}="):
            tiny_config("diffusion_gemma", **over)


def _gemma_dict(**text):
    d = tiny_config("diffusion_gemma").to_hf_dict()
    d["text_config"].update(text)
    return d


@pytest.mark.parametrize("text, needle", [
    ({"head_dim": 8.5}, "text_config: unsupported head_dim=8.5 (allowed: a positive integer or null; got a number)"),
    ({"sliding_window": "8"}, "text_config: unsupported sliding_window='8'"),
    ({"rms_norm_eps": NAN}, "text_config: unsupported rms_norm_eps=nan"),
    ({"final_logit_softcapping": -1.0}, "text_config: unsupported final_logit_softcapping=-1.0"),
    ({"eos_token_id": "1"}, "text_config: unsupported eos_token_id='1'"),
    ({"eos_token_id": [1, "x"]}, "text_config: unsupported eos_token_id=[1, 'x']"),
    ({"layer_types": "sliding_attention"}, "text_config: unsupported layer_types='sliding_attention'"),
    ({"layer_types": [SLIDING, FULL]}, "text_config: unsupported layer_types=['sliding_attention', "
                                       "'full_attention'] (allowed: a list of num_hidden_layers=3 entries)"),
    ({"per_layer_config": {"2": 5}}, "text_config: unsupported per_layer_config[2]=5"),
    ({"per_layer_config": {"2": {"head_dim": "32"}}}, "text_config: unsupported per_layer_config[2].head_dim='32'"),
    ({"rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": NAN},
                          FULL: {"rope_type": "default"}}},
     "text_config: unsupported rope_parameters['sliding_attention'].rope_theta=nan"),
    ({"rope_parameters": {SLIDING: {"rope_type": "default"},
                          FULL: {"rope_type": "proportional", "partial_rotary_factor": "0.25"}}},
     "text_config: unsupported rope_parameters['full_attention'].partial_rotary_factor='0.25'"),
    ({"rope_parameters": {SLIDING: {"rope_type": "default"},
                          FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 0}}},
     "text_config: unsupported rope_parameters['full_attention'].factor=0"),
    ({"max_position_embeddings": 8}, "text_config: unsupported canvas_length=16 (allowed: <= "
                                     "max_position_embeddings=8)"),
    ({"attention_bias": "no"}, "text_config: unsupported attention_bias='no'"),
])
def test_gemma_bad_values_named(tmp_path, text, needle):
    path = _write(str(tmp_path), _gemma_dict(**text))
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path))
    assert str(e.value).startswith(path + " text_config: ") and needle in str(e.value), str(e.value)


@pytest.mark.parametrize("top, needle", [
    ({"canvas_length": 0}, "unsupported canvas_length=0"),
    ({"canvas_length": True}, "unsupported canvas_length=True"),
    ({"tie_word_embeddings": "true"}, "unsupported tie_word_embeddings='true'"),
    ({"image_token_id": -5}, "unsupported image_token_id=-5"),
    ({"vision_config": []}, "unsupported vision_config=[]"),
])
def test_gemma_top_level_named(tmp_path, top, needle):
    path = _write(str(tmp_path), {**_gemma_dict(), **top})
    with pytest.raises(ConfigError, match="^" + re.escape(f"{path}: {needle}")):
        load_config(str(tmp_path))


def test_generation_config_checked(tmp_path):
    _write(str(tmp_path), _gemma_dict())
    gen = tmp_path / "generation_config.json"
    gen.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="^" + re.escape(f"{gen}: holds a list")):
        load_config(str(tmp_path))
    gen.write_text(json.dumps({"eos_token_id": "1"}))
    with pytest.raises(ConfigError, match="^" + re.escape(f"{gen}: unsupported eos_token_id='1'")):
        load_config(str(tmp_path))


@pytest.mark.parametrize("content, needle", [
    ("[1, 2, 3]", "holds a list ([1, 2, 3]), expected a JSON object"),
    ("42", "holds an integer (42), expected a JSON object"),
    ('"llada2_moe"', "holds a string"),
    ("null", "holds null"),
    ("{", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON (not UTF-8 text"),
    ("[" * 100000 + "]" * 100000, "not valid JSON"),
])
def test_config_json_not_an_object(tmp_path, content, needle):
    path = tmp_path / "config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path))
    assert str(e.value).startswith(f"{path}: ") and needle in str(e.value)


def test_config_json_that_is_a_folder(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match="config.json: cannot be read"):
        load_config(str(tmp_path))


def test_readers_refuse_non_objects_directly():
    with pytest.raises(ConfigError, match="^x.json: holds a list"):
        llada_config_from_dict([1], "x.json")
    with pytest.raises(ConfigError, match="^x.json: holds an integer"):
        GemmaConfig.from_hf_dict(3, "x.json")


# ---------------------------------------------------------------------------------------------------------------
# plausibility: refused at once, naming the key, the count and the limit
# ---------------------------------------------------------------------------------------------------------------

def _fast_error(fn):
    t = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        fn()
    assert time.perf_counter() - t < 0.5
    return str(e.value)


@pytest.mark.parametrize("patch, key", [
    ({"num_hidden_layers": 1_000_000_000}, "num_hidden_layers=1000000000"),
    ({"num_experts": 67_108_864, "n_group": 1, "topk_group": 1}, "num_experts=67108864"),
    ({"vocab_size": 10 ** 15, "mask_token_id": 3, "eos_token_id": 2}, "vocab_size=1000000000000000"),
    ({"hidden_size": 2 ** 40, "num_attention_heads": 16}, "hidden_size=1099511627776"),
])
def test_implausible_llada_refused_fast(tmp_path, patch, key):
    _write(str(tmp_path), {**MINI, **patch})
    msg = _fast_error(lambda: load_config(str(tmp_path)))
    assert f"implausible {key}: the model would have " in msg and "parameters" in msg
    assert "over the limit of" in msg and "RAM" in msg and "DBLOCK_MAX_PARAMS" in msg


def test_implausible_tensor_count_refused():
    msg = _fast_error(lambda: llada_config_from_dict({
        **MINI, "num_experts": 1_000_000, "n_group": 1, "topk_group": 1, "hidden_size": 16, "num_attention_heads": 1,
        "num_key_value_heads": 1, "head_dim": 16, "moe_intermediate_size": 1, "intermediate_size": 1,
        "vocab_size": 157184}))
    assert "implausible num_experts=1000000: the checkpoint would hold 57,000,221 tensors, over the limit of " \
           "1,000,000" in msg


def test_implausible_gemma_refused_before_layer_types_are_built():
    d = _gemma_dict(num_hidden_layers=1_000_000_000)
    del d["text_config"]["layer_types"]
    del d["text_config"]["per_layer_config"]
    msg = _fast_error(lambda: GemmaConfig.from_hf_dict(d, "x/config.json"))
    assert msg.startswith("x/config.json text_config: implausible num_hidden_layers=1000000000")
    d = _gemma_dict(num_experts=2 ** 36)
    assert f"implausible num_experts={2 ** 36}" in _fast_error(lambda: GemmaConfig.from_hf_dict(d, "x/config.json"))


def test_info_refuses_implausible_config_at_once(tmp_path, capsys):
    from dblock.cli import main
    _write(str(tmp_path), {**MINI, "num_hidden_layers": 1_000_000_000})
    t = time.perf_counter()
    rc = main(["info", str(tmp_path)])
    assert time.perf_counter() - t < 1.0
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("dblock: error: ") and len(err.strip().splitlines()) == 1
    assert "implausible num_hidden_layers=1000000000" in err


def test_limit_env_override(monkeypatch):
    n = llada_config_from_dict(MINI).param_count()
    monkeypatch.setenv("DBLOCK_MAX_PARAMS", str(n - 1))
    with pytest.raises(ConfigError, match=rf"over the limit of .* parameters \(DBLOCK_MAX_PARAMS\)"):
        llada_config_from_dict(MINI)
    monkeypatch.setenv("DBLOCK_MAX_PARAMS", str(n))
    llada_config_from_dict(MINI)
    monkeypatch.setenv("DBLOCK_MAX_PARAMS", "1e30")
    llada_config_from_dict({**MINI, "num_hidden_layers": 1000})   # 0.8e12 parameters
    monkeypatch.setenv("DBLOCK_MAX_PARAMS", "lots")
    with pytest.raises(ConfigError, match="DBLOCK_MAX_PARAMS='lots'"):
        llada_config_from_dict(MINI)


def test_default_limit_is_ram_times_factor(monkeypatch):
    monkeypatch.delenv("DBLOCK_MAX_PARAMS", raising=False)
    limit, how = validate.param_limit()
    assert limit == validate.ram_bytes() * validate.RAM_FACTOR // validate.BYTES_PER_PARAM and "RAM" in how
    assert validate.ram_bytes() > 2 ** 28
    monkeypatch.setattr(validate, "ram_bytes", lambda: 8 << 30)      # an 8 GiB laptop still reads LLaDA2.0-mini
    llada_config_from_dict(MINI)


# ---------------------------------------------------------------------------------------------------------------
# property tests: random valid configs load (and are counted exactly); one corrupted key is named
# ---------------------------------------------------------------------------------------------------------------

@st.composite
def llada_dicts(draw, family="llada2_moe"):
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0]))
    head_dim = draw(st.sampled_from([4, 8, 12, 16]))
    E = draw(st.integers(1, 24))
    layers = draw(st.integers(1, 4))
    vocab = draw(st.integers(3, 300))
    mask, eos = draw(st.lists(st.integers(0, vocab - 1), min_size=2, max_size=2, unique=True))
    max_pos = draw(st.integers(1, 4096))
    d = {
        "vocab_size": vocab, "hidden_size": heads * draw(st.integers(1, 8)), "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "num_experts": E,
        "rope_theta": draw(st.floats(1.0, 1e7)), "rms_norm_eps": draw(st.floats(1e-12, 0.1)),
        "partial_rotary_factor": draw(st.sampled_from([0.5, 1.0])), "max_position_embeddings": max_pos,
        "block_size": draw(st.integers(1, max_pos)), "mask_token_id": mask, "eos_token_id": eos,
        "pad_token_id": draw(st.integers(0, vocab - 1)), "moe_router_enable_expert_bias": draw(st.booleans()),
        "tie_word_embeddings": False,
    }
    if family == "llada2_moe":
        groups = [g for g in range(1, E + 1) if E % g == 0 and (g == 1 or E // g >= 2)]
        g = draw(st.sampled_from(groups))
        tg = draw(st.integers(1, g))
        top = E if g == 1 else tg * (E // g)
        d.update(model_type="llada2_moe", intermediate_size=draw(st.integers(1, 64)),
                 moe_intermediate_size=draw(st.integers(1, 32)), num_experts_per_tok=draw(st.integers(1, top)),
                 num_shared_experts=draw(st.integers(0, 2)), first_k_dense_replace=draw(st.integers(0, layers)),
                 n_group=g, topk_group=tg, routed_scaling_factor=draw(st.floats(0.1, 10.0)),
                 use_qk_norm=draw(st.booleans()))
    else:
        d.update(model_type="llada", expert_intermediate_size=draw(st.integers(1, 32)),
                 num_experts_per_tok=draw(st.integers(1, E)), qk_layernorm=draw(st.booleans()),
                 dense_intermediate_size=draw(st.integers(0, 64)))
    return d


@st.composite
def gemma_configs(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    divisors = [k for k in (1, 2, 4) if heads % k == 0]
    layers = draw(st.integers(1, 5))
    types = draw(st.lists(st.sampled_from([SLIDING, FULL]), min_size=layers - 1, max_size=layers - 1)) + [FULL]
    E = draw(st.integers(1, 12))
    vocab = draw(st.integers(3, 300))
    max_pos = draw(st.integers(1, 4096))
    rope = default_rope_parameters()
    rope[FULL]["partial_rotary_factor"] = draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]))
    return GemmaConfig(
        vocab_size=vocab, hidden_size=heads * draw(st.integers(1, 8)), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=draw(st.sampled_from(divisors)),
        head_dim=draw(st.sampled_from([2, 4, 8])), global_head_dim=draw(st.sampled_from([2, 4, 8, 16])),
        num_global_key_value_heads=draw(st.sampled_from(divisors)), intermediate_size=draw(st.integers(1, 64)),
        moe_intermediate_size=draw(st.integers(1, 32)), num_experts=E, top_k_experts=draw(st.integers(1, E)),
        layer_types=types, sliding_window=draw(st.integers(2, 64)), rope_parameters=rope,
        rms_norm_eps=draw(st.floats(1e-12, 0.1)), final_logit_softcapping=draw(st.floats(0.5, 100.0)),
        canvas_length=draw(st.integers(1, max_pos)), tie_word_embeddings=draw(st.booleans()),
        eos_token_ids=tuple(draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3))),
        pad_token_id=draw(st.integers(0, vocab - 1)), bos_token_id=draw(st.none() | st.integers(0, vocab - 1)),
        image_token_id=None, max_position_embeddings=max_pos, vision_config=dict(TINY_VISION)).validate("random")


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["llada2_moe", "llada_moe"]).flatmap(llada_dicts))
def test_random_valid_llada_configs_load(d):
    cfg = llada_config_from_dict(d, "r.json")
    assert (cfg.param_count(), _tensors(cfg)) == _slot_counts(cfg)


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(gemma_configs())
def test_random_valid_gemma_configs_load(cfg):
    again = GemmaConfig.from_hf_dict(cfg.to_hf_dict(), "r.json")
    assert again == cfg
    assert (cfg.param_count(), _tensors(cfg)) == _slot_counts(cfg)


def _bad_values(f: validate.Field) -> list:
    """Values that break `f` whatever the rest of the config is."""
    common = [{"a": 1}, "7"] + ([] if f.null else [None])
    if f.kind in ("int", "ids"):
        out = common + [8.5, 2.0, True, NAN, -1] + ([0] if f.lo == 1 else [])
        return out + ([[]] if f.kind == "ids" else [[1]])
    if f.kind == "float":
        out = common + [True, NAN, INF, -INF, -1.0, [1.0]]
        return out + ([0, 0.0] if f.lo == 0 and f.lo_open else []) + ([1.5] if f.hi == 1 else [])
    if f.kind == "bool":
        return common + [1, 0, "false", [True]]
    if f.kind == "object":
        return ["x", 3, [1]]
    if f.kind == "list":
        return ["x", 3, {"a": 1}]
    raise AssertionError(f.kind)


def _corrupt(draw, d, table):
    key = draw(st.sampled_from(sorted(k for k in table if k in d)))
    return key, draw(st.sampled_from(_bad_values(table[key])))


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_one_corrupted_llada_key_is_named(data):
    family = data.draw(st.sampled_from(["llada2_moe", "llada_moe"]))
    d = data.draw(llada_dicts(family))
    table = LLADA2_KEYS if family == "llada2_moe" else LLADA_MOE_KEYS
    key, bad = _corrupt(data.draw, d, table)
    with pytest.raises(ConfigError) as e:    # never another exception type
        llada_config_from_dict({**d, key: bad}, "r/config.json")
    assert str(e.value).startswith(f"r/config.json: unsupported {key}="), (key, bad, str(e.value))


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_one_corrupted_gemma_key_is_named(data):
    d = data.draw(gemma_configs()).to_hf_dict()
    d["text_config"].pop("per_layer_config")   # global dims come from the keys themselves
    cfg = GemmaConfig.from_hf_dict(d, "r.json")
    d["text_config"].update(global_head_dim=cfg.global_head_dim,
                            num_global_key_value_heads=cfg.num_global_key_value_heads)
    tc = d["text_config"]
    key, bad = _corrupt(data.draw, tc, {k: f for k, f in GEMMA_TEXT_KEYS.items() if k != "per_layer_config"})
    tc[key] = bad
    with pytest.raises(ConfigError) as e:
        GemmaConfig.from_hf_dict(d, "r/config.json")
    msg = str(e.value)
    assert msg.startswith("r/config.json text_config: ") and (f"unsupported {key}=" in msg or
                                                              f"missing key {key!r}" in msg), (key, bad, msg)
