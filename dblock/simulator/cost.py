"""Roofline cost of one denoising pass, and the memory it needs.

A pass runs `batch` requests, each with `rows_per_request` in-flight positions (C for Native(C), 2C for OBA /
Dense Mask / Native(2C)) over a committed prefix of `cache_len` keys, on one model replica sharded TP/EP/SP ways.
Every component is timed on one rank (the work is balanced, so one rank is the critical path) as

    t = max(FLOPs / (peak · eff.gemm), bytes / (HBM · eff.stream))     compute-or-memory roofline
    t_collective = latency floor + bytes / achieved bus bandwidth

and the pass time is the sum over components plus the calibrated terms of `Calibration`:

    eff           the serving class's efficiency: every roofline component (not the collectives' bytes) is divided
                  by it (1 = the class the GEMM and stream fractions were fitted for)
    gemm          achieved GEMM fraction per precision, ((dtype, fraction), ...), replacing the hardware table's
                  `eff.gemm` for those precisions; `stream_scale` multiplies the hardware's stream fraction
    pass_s        a fixed time per pass (host work, sampler, graph launch)
    layer_s       a fixed time per layer (kernel launches and small-collective floors the roofline does not see),
                  counted half in the attention sub-block and half in the FFN/MoE sub-block
    a2a_s         the floor of one all-to-all (dispatch or combine), replacing the hardware table's latency
    overhead_s    (older form) a fixed time per sub-block: `layer_s = 2 · overhead_s`
    moe_row_s     (older form) achieved time per *padded expert row* per MoE layer, summed over the replica,
                  counted as touched · max(m, knee) rows (the grouped-GEMM tile pads each touched expert to `knee`
                  rows). 0 = pure roofline.

The fitted values (`gpufit.py`, fitted on published measurements: SIMULATOR.md, "The GPU cost model against
published measurements") give one `Calibration` per serving class.

Shapes (per layer; N = rows in the pass, H hidden, D head dim, nH/nKV heads, E experts, K top-k, I expert width):

    attention projections   2·N·H·(nH + 2 nKV)·D + 2·N·nH·D·H FLOPs / tp
    attention core          4·D·nH·Σ_requests (queries × visible keys) / tp; the paired (OBA) layout skips the
                            tiles where current-block queries meet warm-up keys: C(L+C) + C(L+2C) instead of 2C(L+2C)
    KV reads                Σ visible keys · 2·nKV_rank·D·bytes (nKV_rank = max(1, nKV / tp): heads replicate)
    dense FFN               6·N·H·I_dense / tp
    router                  2·N_moe·H·E / sp (fp32 scores), routing stream N_moe·E·4·3 / sp
    MoE pairs               P = N_moe·K, N_moe = N (dense) or fresh rows (Epoch LSP)
    experts touched         S·(1 − (1 − K/S)^N_moe) of the eligible S = support_frac·E (uniform routing, K distinct
                            experts per token); rows per expert m = P / touched
    expert GEMMs            6·H·I·max(m, knee)·touched / ep FLOPs (tile padding below the knee), weights
                            3·H·I·bytes·touched / ep; with ep = 1 and tp > 1 the routed experts are sharded TP ways
                            (each rank holds 1/tp of every expert, one all-reduce combines them: SGLang's and vLLM's
                            default without expert parallelism)
    dispatch/combine        per direction N_moe/sp · ranks_per_token · (ep − 1)/ep · H · bytes, ranks_per_token =
                            ep·(1 − (1 − 1/ep)^K) (DeepEP sends a token once per destination rank)
    shared expert           6·N_moe·H·I·n_shared / tp
    LM head                 2·rows_lm·H·V / tp, rows_lm = all in-flight rows (dense) or live rows (Epoch)
    TP collectives          one all-reduce-equivalent (reduce-scatter + all-gather under SP) per sub-block of
                            N·H·bytes: latency + 2(tp − 1)/tp · bytes / busbw

Epoch (docs/algorithms.md §4) changes only: N_moe = fresh rows (router, routed and shared experts: a stable row's whole
MoE output is served from the cache); experts eligible = the atlas support; rows_lm = live rows; plus a
count-exchange all-to-all per MoE layer (latency floor) and the decoded-output cache merge (stream bytes).

Memory per rank: weights, KV cache (batch · max_context keys), and the peak activations of a pass, including the
fp32 logits and probabilities of every LM-head row over the full vocabulary (the "full-block logits" of a dense
sampler) and the dense MoE dispatch buffers.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

from dblock.config import ModelConfig, family_of, llada_config_from_dict, read_json
from dblock.simulator.hardware import Hardware

LAYOUTS = ("native", "oba", "dense_mask", "native2c")
PATHS = ("dense", "epoch")


def llada2_mini() -> ModelConfig:
    """LLaDA2.0-mini (16B-A1.4B) from the values in docs/models.md (HF config.json)."""
    return llada_config_from_dict(dict(
        model_type="llada2_moe", vocab_size=157184, hidden_size=2048, num_hidden_layers=20, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128, intermediate_size=5120, moe_intermediate_size=512, num_experts=256,
        num_experts_per_tok=8, num_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        first_k_dense_replace=1, score_function="sigmoid", moe_router_enable_expert_bias=True, norm_topk_prob=True,
        use_qk_norm=True, partial_rotary_factor=0.5, rope_theta=600000, rms_norm_eps=1e-6,
        max_position_embeddings=32768, pad_token_id=156892), "LLaDA2.0-mini (docs/models.md)")


def llada_moe_7b() -> ModelConfig:
    """LLaDA-MoE-7B-A1B from docs/models.md (every layer MoE, no shared expert)."""
    return llada_config_from_dict(dict(
        model_type="llada", vocab_size=157184, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, expert_intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
        rope_theta=50000, max_position_embeddings=8192, qk_layernorm=True), "LLaDA-MoE-7B (docs/models.md)")


def llada2_flash() -> ModelConfig:
    """LLaDA2.0-flash (100B-A6.1B) from docs/models.md: LLaDA2.0-mini's code at Ling-flash-2.0's shapes."""
    return llada_config_from_dict(dict(
        model_type="llada2_moe", vocab_size=157184, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=9216, moe_intermediate_size=1024, num_experts=256,
        num_experts_per_tok=8, num_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        first_k_dense_replace=1, score_function="sigmoid", moe_router_enable_expert_bias=True, norm_topk_prob=True,
        use_qk_norm=True, partial_rotary_factor=0.5, rope_theta=600000, rms_norm_eps=1e-6,
        max_position_embeddings=32768, pad_token_id=156892), "LLaDA2.0-flash (docs/models.md)")


def diffusion_gemma() -> ModelConfig:
    """DiffusionGemma-26B-A4B's text model (docs/models.md) as the cost model's LLaDA shape, for pricing only:
    the dense MLP that runs beside the experts in every layer is a shared expert of the same width (3 x 704 = 2112:
    the same FLOPs and bytes), every layer is MoE, the sliding layers are priced as full attention (an upper bound
    past the 1024-token window), the canvas is the block (C = 256). Uniform-state: OBA applies."""
    return llada_config_from_dict(dict(
        model_type="llada2_moe", vocab_size=262144, hidden_size=2816, num_hidden_layers=30, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, intermediate_size=2112, moe_intermediate_size=704, num_experts=128,
        num_experts_per_tok=8, num_shared_experts=3, n_group=1, topk_group=1, first_k_dense_replace=0,
        score_function="sigmoid", max_position_embeddings=32768, block_size=256, mask_token_id=4,
        eos_token_id=1, pad_token_id=0),
        "DiffusionGemma-26B-A4B, priced as a LLaDA shape (docs/models.md)")


MODELS = {"llada2-mini": llada2_mini, "llada2-flash": llada2_flash, "llada-moe-7b": llada_moe_7b,
          "diffusion-gemma": diffusion_gemma}
#: models whose waiting block decodes (uniform-state): One Block Ahead can pay on them (docs/algorithms.md §3)
UNIFORM_STATE = {"diffusion-gemma"}


def get_model(name_or_path: str) -> ModelConfig:
    """A named model (llada2-mini, llada-moe-7b) or a folder / config.json read with dblock.config.load_config."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]()
    if not os.path.exists(name_or_path):
        raise ValueError(f"model {name_or_path!r}: not a known name ({', '.join(MODELS)}) nor a path")
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    d = read_json(path)
    # checked on the model_type, before its config is read: a DiffusionGemma config is refused as such
    if family_of(d, path) == "diffusion_gemma":
        raise ValueError(f"model {name_or_path!r}: the cost model covers the LLaDA families only (diffusion_gemma "
                         "is not modelled yet)")
    return llada_config_from_dict(d, path)


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    ep: int = 1
    sp: int = 1

    def __post_init__(self):
        for k in ("tp", "ep", "sp"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k}={getattr(self, k)}: must be >= 1")

    @property
    def world(self) -> int:
        return max(self.tp, self.ep, self.sp)


@dataclass(frozen=True)
class Calibration:
    """The calibrated terms; see the module docstring. `scale` multiplies the whole pass (CPU fits)."""

    overhead_s: float = 0.0
    moe_row_s: float = 0.0
    scale: float = 1.0
    pass_s: float = 0.0
    layer_s: float = 0.0
    a2a_s: float | None = None
    eff: float = 1.0
    gemm: tuple = ()
    stream_scale: float = 1.0

    def __post_init__(self):
        for k in ("overhead_s", "moe_row_s", "pass_s", "layer_s"):
            if not getattr(self, k) >= 0:
                raise ValueError(f"{k}={getattr(self, k)}: must be >= 0")
        for k in ("scale", "eff", "stream_scale"):
            if not getattr(self, k) > 0:
                raise ValueError(f"{k}={getattr(self, k)}: must be > 0")
        if self.a2a_s is not None and not self.a2a_s >= 0:
            raise ValueError(f"a2a_s={self.a2a_s}: must be >= 0")

    def gemm_of(self, dtype: str, hw: Hardware) -> float:
        """The achieved GEMM fraction of `dtype` on `hw`: the fitted one when there is one, else the table's."""
        for k, v in self.gemm:
            if k == dtype:
                return v
        return hw.eff.gemm


@dataclass
class PassShape:
    batch: int = 1
    layout: str = "native"       # native | oba | dense_mask | native2c
    block: int = 32              # C
    cache_len: float = 0.0       # mean committed prefix (keys in the KV cache) per request
    path: str = "dense"          # dense | epoch
    live_frac: float = 1.0       # live share of in-flight rows (Epoch LM head)
    fresh_frac: float = 1.0      # fresh share of rows through routed experts (Epoch LSP)
    support_frac: float = 1.0    # eligible experts / E (Epoch Expert Atlas); 1 = all
    extra_rows: int = 0          # prefill/append rows folded into this iteration (no LM head, all fresh)
    no_cache: bool = False       # recompute the committed prefix every pass (llada_moe / dInfer without cache)
    lm_rows: str = "block"       # dense path LM head: "block" (all in-flight rows) | "live"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}: allowed {', '.join(LAYOUTS)}")
        if self.path not in PATHS:
            raise ValueError(f"path={self.path!r}: allowed {', '.join(PATHS)}")
        if self.batch < 0 or self.block <= 0:
            raise ValueError(f"batch={self.batch}, block={self.block}: batch >= 0 and block > 0")
        for k in ("live_frac", "fresh_frac", "support_frac"):
            v = getattr(self, k)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{k}={v}: must lie in [0, 1]")

    @property
    def rows_per_request(self) -> int:
        return self.block * (1 if self.layout == "native" else 2)

    def query_key_pairs(self) -> float:
        """Σ over one request's queries of the keys each sees (attention work), by layout."""
        C, L = self.block, self.cache_len
        if self.no_cache:
            # the whole sequence is recomputed; block-causal over [prefix ‖ in-flight]
            T = L + self.rows_per_request
            return T * T / 2 + T * C / 2
        if self.layout == "native":
            return C * (L + C)
        if self.layout == "oba":
            # block-causal paired layout: the current block's queries skip the warm-up keys (skipped tiles)
            return C * (L + C) + C * (L + 2 * C)
        return 2 * C * (L + 2 * C)   # dense_mask, native2c: every query sees both halves

    def visible_keys(self) -> float:
        """Keys read from memory per request (the cached prefix plus the in-flight rows)."""
        return self.cache_len + self.rows_per_request


def _roof(flops: float, bytes_: float, hw: Hardware, dtype: str = "bf16", cal: Calibration = Calibration()) -> float:
    t = max(flops / (hw.flops(dtype) * cal.gemm_of(dtype, hw)) if flops else 0.0,
            bytes_ / (hw.hbm_bw * hw.eff.stream * cal.stream_scale))
    return t / cal.eff


def _allreduce(bytes_: float, n: int, hw: Hardware) -> float:
    if n <= 1 or bytes_ <= 0:
        return 0.0
    return hw.eff.allreduce_latency_s + 2.0 * (n - 1) / n * bytes_ / hw.eff.allreduce_busbw


def _a2a(bytes_: float, n: int, hw: Hardware, cal: Calibration = Calibration()) -> float:
    if n <= 1:
        return 0.0
    floor = hw.eff.a2a_latency_s if cal.a2a_s is None else cal.a2a_s
    return floor + bytes_ / hw.eff.a2a_busbw


@dataclass
class PassCost:
    """Seconds per component on one rank (summed over layers) and the total."""

    parts: dict = field(default_factory=dict)
    total: float = 0.0
    rows: float = 0.0
    pairs: float = 0.0
    padded_rows: float = 0.0

    @property
    def moe(self) -> float:
        return sum(v for k, v in self.parts.items() if k.startswith("moe"))

    @property
    def moe_share(self) -> float:
        return self.moe / self.total if self.total else 0.0

    def as_dict(self) -> dict:
        return dict(total=self.total, moe=self.moe, moe_share=self.moe_share, rows=self.rows, pairs=self.pairs,
                    parts=dict(self.parts))


def pass_cost(cfg: ModelConfig, shape: PassShape, hw: Hardware, par: Parallel = Parallel(),
              cal: Calibration = Calibration(), dtype: str = "bf16", wbytes: float = 2.0,
              abytes: float = 2.0, expert_dtype: str | None = None, expert_wbytes: float | None = None) -> PassCost:
    """Time of one pass on one rank (seconds), split by component. See the module docstring for the formulas.
    `dtype`/`wbytes`: the dense layers' GEMM precision and bytes per weight; `expert_dtype`/`expert_wbytes`: the
    routed experts' (default: the same)."""
    H, D, nH, nKV = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    E, K, I, V = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.vocab_size
    L = cfg.num_hidden_layers
    n_moe_layers = len(cfg.moe_layers)
    n_dense_layers = L - n_moe_layers
    tp, ep, sp = par.tp, par.ep, par.sp
    xdt = expert_dtype or dtype
    xwb = wbytes if expert_wbytes is None else expert_wbytes
    B = shape.batch
    inflight = B * shape.rows_per_request
    prefix_rows = B * shape.cache_len if shape.no_cache else 0.0
    N = inflight + prefix_rows + shape.extra_rows           # rows through the layers
    nkv_rank = max(1.0, nKV / tp)
    parts: dict[str, float] = {}

    def roof(flops, bytes_, dt=dtype):
        return _roof(flops, bytes_, hw, dt, cal)

    # ---- attention sub-block (every layer) ----------------------------------------------------------------
    w_attn = (H * (nH + 2 * nKV) * D + nH * D * H) * wbytes / tp
    f_attn_proj = 2 * N * H * (nH + 2 * nKV) * D / tp + 2 * N * nH * D * H / tp
    act_attn = 6 * N * H * abytes / sp                    # norms, rope, residual: ~6 elementwise sweeps
    parts["attn_proj"] = L * (roof(f_attn_proj, w_attn) + roof(0, act_attn))
    qk = B * shape.query_key_pairs()
    if shape.extra_rows:
        qk += shape.extra_rows * (shape.extra_rows / max(1, B) + shape.cache_len) / 2  # causal prefill, roughly
    f_core = 4 * D * nH * qk / tp
    kv_bytes = B * shape.visible_keys() * 2 * nkv_rank * D * abytes
    parts["attn_core"] = L * roof(f_core, kv_bytes, "bf16" if dtype in ("fp8", "fp4") else dtype)
    parts["attn_collective"] = L * _allreduce(N * H * abytes, tp, hw)

    # ---- dense FFN layers --------------------------------------------------------------------------------
    if n_dense_layers:
        Id = cfg.intermediate_size
        parts["dense_ffn"] = n_dense_layers * (roof(6 * N * H * Id / tp, 3 * H * Id * wbytes / tp)
                                               + _allreduce(N * H * abytes, tp, hw))

    # ---- MoE layers --------------------------------------------------------------------------------------
    epoch = shape.path == "epoch"
    n_fresh = (inflight + prefix_rows) * (shape.fresh_frac if epoch else 1.0) + shape.extra_rows
    P = n_fresh * K                                          # routed (token, expert) pairs in the replica
    S = max(K, shape.support_frac * E) if epoch else E       # eligible experts
    # each token picks K distinct experts: an expert is missed by one token with probability 1 − K/S
    touched = S * (1.0 - (1.0 - min(1.0, K / S)) ** n_fresh) if P > 0 else 0.0
    m = P / touched if touched else 0.0
    knee = hw.eff.gemm_knee_rows
    # the routed experts' split: EP ways, or (ep = 1) TP ways inside every expert
    xsplit = ep if ep > 1 else tp
    t_router = roof(2 * n_fresh * H * E / sp, (E * H * 4) + n_fresh * E * 4 * 3 / sp)
    f_exp = 6 * H * I * max(m, knee) * touched / xsplit if P else 0.0
    w_exp = 3 * H * I * xwb * touched / xsplit
    t_exp = roof(f_exp, w_exp, xdt) if P else 0.0
    ranks_per_tok = ep * (1.0 - (1.0 - 1.0 / ep) ** K) if ep > 1 else 1.0
    a2a_bytes = n_fresh / sp * ranks_per_tok * (ep - 1) / ep * H * abytes
    t_disp = 2 * _a2a(a2a_bytes, ep, hw, cal)                # dispatch + combine
    t_perm = roof(0, 4 * P / max(ep, sp) * H * abytes)       # permute, unpermute, weighted sum
    ns = cfg.num_shared_experts
    t_shared = roof(6 * n_fresh * H * I * ns / tp, 3 * H * I * ns * wbytes / tp) if ns else 0.0
    t_moe_coll = _allreduce(N * H * abytes, tp, hw) if ep == 1 else 0.0   # EP combine replaces the TP reduce
    extra = 0.0
    if epoch:
        extra += _a2a(0.0, ep, hw, cal) if ep > 1 else 0.0                  # FreshLane count exchange
        extra += roof(0, (inflight + prefix_rows) * H * abytes * 2 / sp)    # compact + cache merge
    parts["moe_router"] = n_moe_layers * t_router
    parts["moe_experts"] = n_moe_layers * (t_exp + t_perm)
    parts["moe_dispatch"] = n_moe_layers * (t_disp + t_moe_coll)
    parts["moe_shared"] = n_moe_layers * t_shared
    if epoch:
        parts["moe_epoch_extra"] = n_moe_layers * extra
    padded_rows = touched * max(m, knee) if P else 0.0
    parts["moe_rows_calibrated"] = n_moe_layers * cal.moe_row_s * padded_rows / max(xsplit, 1)

    # ---- LM head -----------------------------------------------------------------------------------------
    lm_rows = inflight * (shape.live_frac if (epoch or shape.lm_rows == "live") else 1.0)
    parts["lm_head"] = roof(2 * lm_rows * H * V / tp, V * H * wbytes / tp + lm_rows * V / tp * 4 * 3)

    # ---- fixed overheads ---------------------------------------------------------------------------------
    per_sub = cal.overhead_s + cal.layer_s / 2.0
    parts["overhead"] = per_sub * 2 * L + cal.pass_s
    # the overhead of MoE sub-blocks belongs to the MoE path when reporting the MoE share
    parts["moe_overhead"] = per_sub * n_moe_layers
    parts["overhead"] -= parts["moe_overhead"]
    total = sum(parts.values()) * cal.scale
    if cal.scale != 1.0:
        parts = {k: v * cal.scale for k, v in parts.items()}
    return PassCost(parts, total, N, P, padded_rows)


# ---- memory -------------------------------------------------------------------------------------------------

@dataclass
class Memory:
    weights: float
    kv_cache: float
    activations: float
    logits: float
    capacity: float

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.activations + self.logits

    @property
    def oom(self) -> bool:
        return self.total > self.capacity

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(total=self.total, oom=self.oom)
        return d


def weight_bytes(cfg: ModelConfig, par: Parallel = Parallel(), wbytes: float = 2.0) -> float:
    """Weights held by one rank: attention, dense FFN, shared experts and embeddings split TP ways, routed experts
    split EP ways (TP ways when ep = 1); router and norms replicated."""
    H, D, nH, nKV = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    L = cfg.num_hidden_layers
    nm = len(cfg.moe_layers)
    attn = L * (H * (nH + 2 * nKV) * D + nH * D * H)
    dense = (L - nm) * 3 * H * cfg.intermediate_size
    shared = nm * 3 * H * cfg.moe_intermediate_size * cfg.num_shared_experts
    emb = 2 * cfg.vocab_size * H
    experts = nm * cfg.num_experts * 3 * H * cfg.moe_intermediate_size
    router = nm * cfg.num_experts * H * 2  # fp32 router weights (stored as 2 bf16-sized words)
    xsplit = par.ep if par.ep > 1 else par.tp       # ep = 1: every expert sharded TP ways (see pass_cost)
    return ((attn + dense + shared + emb) / par.tp + experts / xsplit + router) * wbytes


def param_counts(cfg: ModelConfig) -> dict:
    """Total and per-token active parameters (embeddings and LM head included), for checking a config against a
    model card (LLaDA2.0-mini: 16B total, 1.4B active)."""
    H, D, nH, nKV = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    L = cfg.num_hidden_layers
    nm = len(cfg.moe_layers)
    expert = 3 * H * cfg.moe_intermediate_size
    common = (L * (H * (nH + 2 * nKV) * D + nH * D * H) + (L - nm) * 3 * H * cfg.intermediate_size
              + nm * (cfg.num_shared_experts * expert + cfg.num_experts * H) + 2 * cfg.vocab_size * H)
    active = common + nm * cfg.num_experts_per_tok * expert
    return dict(total=common + nm * cfg.num_experts * expert, active=active,
                active_non_embedding=active - 2 * cfg.vocab_size * H)


def memory(cfg: ModelConfig, shape: PassShape, hw: Hardware, par: Parallel = Parallel(), max_context: int = 4096,
           wbytes: float = 2.0, abytes: float = 2.0, usable_frac: float = 0.9) -> Memory:
    """Peak memory of one rank for a pass of this shape; OOM when it exceeds usable_frac of HBM (runtimes keep
    ~10% for the CUDA context, allocator fragmentation and graphs)."""
    H, D, V = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    L, K, I = cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    B = shape.batch
    nkv_rank = max(1.0, cfg.num_key_value_heads / par.tp)
    kv = B * max_context * L * 2 * nkv_rank * D * abytes
    inflight = B * shape.rows_per_request
    N = inflight + (B * shape.cache_len if shape.no_cache else 0) + shape.extra_rows
    epoch = shape.path == "epoch"
    n_fresh = N * (shape.fresh_frac if epoch else 1.0)
    # hidden states under SP (residual, normed input, attention out, MLP out) + the MoE buffers of one layer:
    # received rows (one per (token, local expert)), gate/up intermediate (2I), output rows
    pairs_rank = n_fresh * K / par.ep
    act = 4 * N / par.sp * H * abytes + pairs_rank * (2 * H + 2 * I) * abytes
    if epoch:
        # decoded-output cache: routed output of every in-flight row, every MoE layer, under SP
        act += len(cfg.moe_layers) * inflight / par.sp * H * abytes
    lm_rows = inflight * (shape.live_frac if (epoch or shape.lm_rows == "live") else 1.0)
    # the sampler's fp32 logits and probabilities over the full vocabulary; Epoch's live rows are sharded SP ways
    logits = lm_rows / (par.sp if epoch else 1) * V * 4 * 2
    return Memory(weight_bytes(cfg, par, wbytes), kv, act, logits, hw.hbm_bytes * usable_frac)


# ---- schedule ratios ---------------------------------------------------------------------------------------

def r_of(cfg: ModelConfig, layout: str, hw: Hardware, par: Parallel = Parallel(), cal: Calibration = Calibration(),
         block: int | None = None, cache_len: float = 0.0, batch: int = 1) -> float:
    """r of a layout: T_den(layout) / T_den(Native C) at the same batch (the paper measures it at batch 1)."""
    C = block or cfg.block_size
    base = pass_cost(cfg, PassShape(batch=batch, layout="native", block=C, cache_len=cache_len), hw, par, cal).total
    other = pass_cost(cfg, PassShape(batch=batch, layout=layout, block=C, cache_len=cache_len), hw, par, cal).total
    return other / base


def with_(shape: PassShape, **kw) -> PassShape:
    return replace(shape, **kw)
