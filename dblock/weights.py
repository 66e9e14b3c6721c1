"""Local Hugging Face folders <-> models. Never touches the network.

A model folder holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Everything is validated before any tensor is used: unknown model_type, unsupported
config value, missing or unexpected key, wrong shape, unreadable or truncated file, NaN/Inf in a weight -> one
`WeightsError` naming the file and key.

Families register a `FamilyIO` (expected HF keys and shapes, HF tensors -> model, model -> HF tensors). The LLaDA
families are here; DiffusionGemma registers from `dblock.reference.gemma`.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from dblock.errors import WeightsError
from dblock.config import ConfigError, ModelConfig, family_of, load_config, read_json

CHECKPOINTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")


@dataclass
class FamilyIO:
    expected: Callable[[object], dict]              # cfg -> {hf_key: shape}; optional keys end with "?"
    build: Callable[[object, dict], torch.nn.Module]  # (cfg, {hf_key: tensor}) -> model with weights
    export: Callable[[torch.nn.Module], dict]       # model -> {hf_key: tensor}


FAMILY_IO: dict[str, FamilyIO] = {}


# ---------------------------------------------------------------------------------------------------------------
# LLaDA families: HF names <-> LladaModel parameters
# ---------------------------------------------------------------------------------------------------------------

def _llada_names(cfg: ModelConfig) -> dict:
    """Prefixes of the two HF layouts."""
    if cfg.family == "llada2_moe":
        return dict(embed="model.word_embeddings.weight", attn="attention", qkv=("query_key_value",),
                    q_norm="query_layernorm", k_norm="key_layernorm", o="dense",
                    bias="mlp.gate.expert_bias", shared="mlp.shared_experts")
    return dict(embed="model.embed_tokens.weight", attn="self_attn", qkv=("q_proj", "k_proj", "v_proj"),
                q_norm="q_norm", k_norm="k_norm", o="o_proj", bias="mlp.expert_bias", shared=None)


def llada_expected(cfg: ModelConfig) -> dict:
    n = _llada_names(cfg)
    H, V, D = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    shapes = {n["embed"]: (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        a = p + n["attn"] + "."
        if len(n["qkv"]) == 1:
            shapes[a + "query_key_value.weight"] = (nq + 2 * nkv, H)
        else:
            shapes[a + "q_proj.weight"], shapes[a + "k_proj.weight"], shapes[a + "v_proj.weight"] = \
                (nq, H), (nkv, H), (nkv, H)
        if cfg.use_qk_norm:
            shapes[a + n["q_norm"] + ".weight"] = (D,)
            shapes[a + n["k_norm"] + ".weight"] = (D,)
        shapes[a + n["o"] + ".weight"] = (H, nq)
        if not cfg.is_moe_layer(i):
            Id = cfg.intermediate_size
            shapes.update({p + "mlp.gate_proj.weight": (Id, H), p + "mlp.up_proj.weight": (Id, H),
                           p + "mlp.down_proj.weight": (H, Id)})
            continue
        shapes[p + "mlp.gate.weight"] = (E, H)
        if cfg.use_expert_bias:
            shapes[p + n["bias"]] = (E,)
        for j in range(E):
            e = p + f"mlp.experts.{j}."
            shapes.update({e + "gate_proj.weight": (I, H), e + "up_proj.weight": (I, H),
                           e + "down_proj.weight": (H, I)})
        if cfg.num_shared_experts:
            Is = I * cfg.num_shared_experts
            s = p + n["shared"] + "."
            shapes.update({s + "gate_proj.weight": (Is, H), s + "up_proj.weight": (Is, H),
                           s + "down_proj.weight": (H, Is)})
    return shapes


def llada_build(cfg: ModelConfig, t: dict) -> torch.nn.Module:
    from dblock.reference.llada import LladaModel

    n = _llada_names(cfg)
    with torch.device("meta"):
        model = LladaModel(cfg)
    sd = {"embed.weight": t[n["embed"]], "norm.weight": t["model.norm.weight"], "lm_head.weight": t["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        a = p + n["attn"] + "."
        sd[q + "attn_norm.weight"] = t[p + "input_layernorm.weight"]
        sd[q + "mlp_norm.weight"] = t[p + "post_attention_layernorm.weight"]
        if len(n["qkv"]) == 1:
            sd[q + "attn.wqkv.weight"] = t[a + "query_key_value.weight"]
        else:  # rows Q, K, V: the same fused layout as LLaDA2
            sd[q + "attn.wqkv.weight"] = torch.cat([t[a + k + ".weight"] for k in n["qkv"]], dim=0)
        if cfg.use_qk_norm:
            sd[q + "attn.q_norm.weight"] = t[a + n["q_norm"] + ".weight"]
            sd[q + "attn.k_norm.weight"] = t[a + n["k_norm"] + ".weight"]
        sd[q + "attn.wo.weight"] = t[a + n["o"] + ".weight"]
        if not cfg.is_moe_layer(i):
            for w in ("gate", "up", "down"):
                sd[q + f"mlp.{w}.weight"] = t[p + f"mlp.{w}_proj.weight"]
            continue
        sd[q + "mlp.gate.weight"] = t[p + "mlp.gate.weight"]
        if cfg.use_expert_bias:
            sd[q + "mlp.expert_bias"] = t[p + n["bias"]].float()
        for w in ("gate", "up", "down"):
            sd[q + f"mlp.w_{w}"] = torch.stack([t[p + f"mlp.experts.{j}.{w}_proj.weight"]
                                                for j in range(cfg.num_experts)])
        if cfg.num_shared_experts:
            for w in ("gate", "up", "down"):
                sd[q + f"mlp.shared.{w}.weight"] = t[p + n["shared"] + f".{w}_proj.weight"]
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval()


def llada_export(model) -> dict:
    cfg = model.config
    n = _llada_names(cfg)
    sd = model.state_dict()
    out = {n["embed"]: sd["embed.weight"], "model.norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"]}
    nq, nkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        a = p + n["attn"] + "."
        out[p + "input_layernorm.weight"] = sd[q + "attn_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[q + "mlp_norm.weight"]
        wqkv = sd[q + "attn.wqkv.weight"]
        if len(n["qkv"]) == 1:
            out[a + "query_key_value.weight"] = wqkv
        else:
            for k, part in zip(n["qkv"], wqkv.split([nq, nkv, nkv], dim=0)):
                out[a + k + ".weight"] = part
        if cfg.use_qk_norm:
            out[a + n["q_norm"] + ".weight"] = sd[q + "attn.q_norm.weight"]
            out[a + n["k_norm"] + ".weight"] = sd[q + "attn.k_norm.weight"]
        out[a + n["o"] + ".weight"] = sd[q + "attn.wo.weight"]
        if not cfg.is_moe_layer(i):
            for w in ("gate", "up", "down"):
                out[p + f"mlp.{w}_proj.weight"] = sd[q + f"mlp.{w}.weight"]
            continue
        out[p + "mlp.gate.weight"] = sd[q + "mlp.gate.weight"]
        if cfg.use_expert_bias:
            out[p + n["bias"]] = sd[q + "mlp.expert_bias"].float()
        for w in ("gate", "up", "down"):
            for j in range(cfg.num_experts):
                out[p + f"mlp.experts.{j}.{w}_proj.weight"] = sd[q + f"mlp.w_{w}"][j]
        if cfg.num_shared_experts:
            for w in ("gate", "up", "down"):
                out[p + n["shared"] + f".{w}_proj.weight"] = sd[q + f"mlp.shared.{w}.weight"]
    return out


FAMILY_IO["llada2_moe"] = FAMILY_IO["llada_moe"] = FamilyIO(llada_expected, llada_build, llada_export)


def _family_io(family: str) -> FamilyIO:
    if family == "diffusion_gemma" and family not in FAMILY_IO:
        import dblock.reference.gemma  # noqa: F401  (registers its FamilyIO)
    return FAMILY_IO[family]


# ---------------------------------------------------------------------------------------------------------------
# Reading and validating a folder
# ---------------------------------------------------------------------------------------------------------------

def resolve_model_path(name_or_path: str) -> str:
    """A folder path, or the name of a bundled checkpoint (`tiny-masked`, `tiny-uniform`)."""
    if os.path.isdir(name_or_path):
        return name_or_path
    bundled = os.path.join(CHECKPOINTS_DIR, name_or_path)
    if os.path.isdir(bundled):
        return bundled
    names = sorted(d for d in os.listdir(CHECKPOINTS_DIR) if os.path.isfile(os.path.join(CHECKPOINTS_DIR, d,
                                                                                          "config.json"))) \
        if os.path.isdir(CHECKPOINTS_DIR) else []
    raise WeightsError(f"{name_or_path}: no such model folder, and not a bundled model "
                       f"(bundled: {', '.join(names) or 'none'})")


def _shard_files(folder: str) -> dict:
    """{hf_key: file} from the index, or from the single model.safetensors."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index):
        d = read_json(index)
        wmap = d.get("weight_map")
        if not isinstance(wmap, dict):
            raise WeightsError(f"{index}: no 'weight_map' object")
        files = {}
        for f in sorted(set(wmap.values())):
            path = os.path.join(folder, f)
            if not os.path.isfile(path):
                raise WeightsError(f"{index}: shard {f!r} listed but missing")
        key_file = {k: os.path.join(folder, f) for k, f in wmap.items()}
        # every key of every shard must be in the index, and vice versa
        for f in sorted(set(key_file.values())):
            try:
                with safe_open(f, "pt") as h:
                    keys = set(h.keys())
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise WeightsError(f"{f}: unreadable safetensors file ({e})") from None
            listed = {k for k, v in key_file.items() if v == f}
            for k in sorted(listed - keys):
                raise WeightsError(f"{f}: key {k!r} listed in the index but not in the shard")
            for k in sorted(keys - listed):
                raise WeightsError(f"{f}: key {k!r} in the shard but not listed in the index")
            files.update({k: f for k in keys})
        return files
    if os.path.isfile(single):
        try:
            with safe_open(single, "pt") as h:
                return {k: single for k in h.keys()}
        except Exception as e:
            raise WeightsError(f"{single}: unreadable safetensors file ({e})") from None
    raise WeightsError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def read_tensors(folder: str, expected: dict, dtype=None, device=None) -> dict:
    """Read and validate every expected tensor; keys in `expected` ending with '?' are optional."""
    from safetensors import safe_open

    key_file = _shard_files(folder)
    required = {k for k in expected if not k.endswith("?")}
    optional = {k[:-1] for k in expected if k.endswith("?")}
    shapes = {k.rstrip("?"): s for k, s in expected.items()}
    for k in sorted(required - key_file.keys()):
        raise WeightsError(f"{folder}: missing key {k!r}")
    for k in sorted(key_file.keys() - required - optional):
        raise WeightsError(f"{key_file[k]}: unexpected key {k!r}")
    out = {}
    by_file: dict = {}
    for k, f in key_file.items():
        by_file.setdefault(f, []).append(k)
    for f, keys in sorted(by_file.items()):
        try:
            with safe_open(f, "pt", device="cpu") as h:
                for k in sorted(keys):
                    meta = h.get_slice(k)
                    shape = tuple(meta.get_shape())
                    if shape != tuple(shapes[k]):
                        raise WeightsError(f"{f}: key {k!r} has shape {shape}, expected {tuple(shapes[k])}")
                    t = h.get_tensor(k)
                    if not t.is_floating_point():
                        raise WeightsError(f"{f}: key {k!r} has dtype {t.dtype}, expected a floating type")
                    if not torch.isfinite(t).all():
                        raise WeightsError(f"{f}: key {k!r} contains NaN or Inf")
                    keep32 = k.endswith("expert_bias")  # stored and used in fp32
                    if dtype is not None and not keep32:
                        t = t.to(dtype)
                    out[k] = t.to(device) if device is not None else t
        except WeightsError:
            raise
        except Exception as e:  # truncated data, bad offsets: safetensors/torch raise various types
            raise WeightsError(f"{f}: unreadable safetensors file ({type(e).__name__}: {e})") from None
    return out


def _dtype(d):
    if d is None or isinstance(d, torch.dtype):
        return d
    table = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if d not in table:
        raise ConfigError(f"dtype={d!r}: allowed {', '.join(table)}")
    return table[d]


def load(path_or_name: str, dtype=None, device=None) -> torch.nn.Module:
    """Load a local HF folder (or a bundled model name) into the family's reference model, validated first.

    dtype: None keeps the stored dtype; "float32"/"bfloat16"/"float64" or a torch dtype converts (expert_bias
    stays fp32). device: where the weights go ("cpu", "cuda").
    """
    folder = resolve_model_path(path_or_name)
    cfg = load_config(folder)
    io = _family_io(cfg.family)
    tensors = read_tensors(folder, io.expected(cfg), _dtype(dtype), device)
    model = io.build(cfg, tensors)
    model.source = folder
    return model


def save(model: torch.nn.Module, out_dir: str, extra_files: Optional[dict] = None,
         max_shard_bytes: Optional[int] = None) -> None:
    """Write config.json + model.safetensors (or shards + index) with HF names. Atomic per folder: files are
    written to a temporary folder beside `out_dir` and moved in only when all of them were written."""
    from safetensors.torch import save_file

    cfg = model.config
    tensors = {k: v.detach().contiguous().cpu() for k, v in _family_io(cfg.family).export(model).items()}
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".dblock-save-", dir=parent)
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg.to_hf_dict(), f, indent=2)
        if max_shard_bytes is None:
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        else:
            shards, cur, size = [], {}, 0
            for k in sorted(tensors):
                nb = tensors[k].numel() * tensors[k].element_size()
                if cur and size + nb > max_shard_bytes:
                    shards.append(cur)
                    cur, size = {}, 0
                cur[k] = tensors[k]
                size += nb
            shards.append(cur)
            wmap = {}
            for i, sh in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(sh, os.path.join(tmp, name), metadata={"format": "pt"})
                wmap.update({k: name for k in sh})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=2)
        for name, content in (extra_files or {}).items():
            mode = "wb" if isinstance(content, bytes) else "w"
            with open(os.path.join(tmp, name), mode) as f:
                f.write(content)
        os.makedirs(out_dir, exist_ok=True)
        for stale in ("model.safetensors", "model.safetensors.index.json"):
            if os.path.exists(os.path.join(out_dir, stale)):
                os.remove(os.path.join(out_dir, stale))
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def model_family(path_or_name: str) -> str:
    folder = resolve_model_path(path_or_name)
    return family_of(read_json(os.path.join(folder, "config.json")), os.path.join(folder, "config.json"))
