"""`dblock info`: what a model folder holds, from its config and safetensors headers (no weights are read)."""
from __future__ import annotations

import math
import os

from safetensors import safe_open

from dblock.config import load_config
from dblock.weights_path import resolve_model_path
from dblock.weights_read import expected, shard_files

_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "U8": 1}


def param_counts(cfg) -> dict:
    """Total parameters, and parameters active for one token (routed experts: only K of E per MoE layer)."""
    shapes = expected(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    expert = sum(math.prod(s) for k, s in shapes.items() if ".experts." in k and ("_proj" in k))
    fused = sum(math.prod(s) for k, s in shapes.items() if k.endswith(("experts.gate_up_proj", "experts.down_proj")))
    routed = expert + fused
    E = cfg.num_experts
    K = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "top_k", None) or E
    inactive = routed * (E - K) / E if E else 0
    embed = cfg.vocab_size * cfg.hidden_size
    return {"total": int(total), "active_per_token": int(total - inactive),
            "active_per_token_excl_embeddings": int(total - inactive - embed), "routed_expert_params": int(routed)}


def model_info(name_or_path: str) -> dict:
    folder = resolve_model_path(name_or_path)
    cfg = load_config(folder)
    nbytes, dtypes = 0, {}
    for f in sorted(set(shard_files(folder).values())):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                dt = sl.get_dtype()
                n = math.prod(sl.get_shape()) * _BYTES.get(dt, 4)
                nbytes += n
                dtypes[dt] = dtypes.get(dt, 0) + n
    counts = param_counts(cfg)
    keys = ["family", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts",
            "num_experts_per_tok", "num_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
            "routed_scaling_factor", "score_function", "use_expert_bias", "norm_topk_prob", "partial_rotary_factor",
            "rope_theta", "use_qk_norm", "rms_norm_eps", "mask_token_id", "eos_token_id", "pad_token_id",
            "block_size"]
    summary = {k: getattr(cfg, k) for k in keys if hasattr(cfg, k)}
    if hasattr(cfg, "summary"):
        summary.update(cfg.summary())
    return {
        "path": folder,
        "config": summary,
        "parameters_total": counts["total"],
        "parameters_active_per_token": counts["active_per_token"],
        "parameters_active_excl_embeddings": counts["active_per_token_excl_embeddings"],
        "weight_bytes": nbytes,
        "weight_memory": _human(nbytes),
        "weight_dtypes": {k: _human(v) for k, v in dtypes.items()},
        "tokenizer": os.path.isfile(os.path.join(folder, "tokenizer.json")),
    }


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)
