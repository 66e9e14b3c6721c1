"""Published GPU measurements as data: the schema, the loader, and the prediction of every point.

A file (`data/published_gpu.json` is the project's; any file in this schema is accepted, so a user can check the
cost model against their own cluster) is a JSON object with a list `points`. One point per measured figure:

| field | meaning |
|---|---|
| `id` | short id, unique in the file; the same source's figures share a prefix |
| `role` | `calibration` (the fit sees it) or `held_out` (only predicted); absent: held out |
| `model` | a model `dblock simulate` knows: `llada2-mini`, `llada2-flash`, `llada-moe-7b`, `diffusion-gemma` (LLaDA2.1 checkpoints have LLaDA2.0's architecture and sizes and are filed under the LLaDA2.0 name) |
| `hardware`, `gpus`, `tp`, `ep` | GPU kind (`hardware.PROFILES`), how many, tensor- and expert-parallel degrees (`null`: not stated; the prediction then takes TP = the GPUs and no EP, SGLang's and vLLM's default) |
| `dtype` | `bf16`, `fp16`, `fp8`, `nvfp4-moe+fp8` (MoE in NVFP4, dense layers in FP8), `q4` |
| `software` | the serving stack the figure was measured on |
| `serving_class` | optional: `engine` (SGLang, vLLM, Diffulex, dInfer, the OBA paper's kernels), `epoch-paper` (everything measured in the Epoch paper's testbed), `moe-replay` (one MoE layer replayed in isolation), `llama.cpp`; absent: inferred from `software` |
| `executor` | optional: `dense` or `epoch` (docs/algorithms.md §4); absent: `epoch` when `software` starts with "Epoch" and names no baseline |
| `decoding` | `schedule` (`native`, `native-2c`, `oba`, `flowblock`, `dense-mask`), `block`, `threshold`, `steps_per_block` (a fixed step count), `tpf` (tokens per forward), `paired_share` (FlowBlock: share of paired passes); `null` where the source is silent |
| `workload` | `batch` or `concurrency`, `rate` (req/s), `prompt_tokens`, `output_tokens` (means), `benchmark`, `local_tokens` (tokens one rank's MoE layer sees) |
| `metric` | `pass_ms`, `canvas_ms` (one whole block), `moe_layer_ms`, `tpot_ms` (time per output token after the first), `ttft_ms`, `tps_per_request` (tokens per second of one request, end to end), `output_tps` (all output tokens / benchmark duration), `request_ms`, `moe_share`, `r` (a pass over Native's pass), `speedup_vs_baseline` (Epoch over the dense path), `p95_equivalent_itl_ms` |
| `value` | a number, or `[low, high]` where the source gives a range |
| `source`, `confidence` | where it was read; `T` table or text value, `F` figure label, `P` prose, `S` relayed by a secondary source |

Unknown keys are refused (a typo must not be ignored); every value is checked here before anything is predicted.
"""
from __future__ import annotations

import json
import math
import os
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dblock.simulator import hardware as _hw

DATA_PATH = os.path.join(os.path.dirname(__file__), "data", "published_gpu.json")

MODELS = ("llada2-mini", "llada2-flash", "llada-moe-7b", "diffusion-gemma")
DTYPES = ("bf16", "fp16", "fp8", "nvfp4-moe+fp8", "q4")
SCHEDULES = ("native", "native-2c", "oba", "flowblock", "dense-mask")
METRICS = ("pass_ms", "canvas_ms", "moe_layer_ms", "tpot_ms", "ttft_ms", "tps_per_request", "output_tps",
           "request_ms", "moe_share", "r", "speedup_vs_baseline", "p95_equivalent_itl_ms")
SERVING_CLASSES = ("engine", "epoch-paper", "moe-replay", "llama.cpp")
ROLES = ("calibration", "held_out")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _pos(v, name):
    if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a positive finite number or null, got {v!r}")
    return v


class Decoding(_Strict):
    schedule: Literal[SCHEDULES] = "native"
    block: Optional[int] = Field(default=None, ge=1, le=1 << 16)
    threshold: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    steps_per_block: Optional[float] = None
    tpf: Optional[float] = None
    paired_share: Optional[float] = Field(default=None, ge=0.0, le=1.0)

    @field_validator("steps_per_block", "tpf")
    @classmethod
    def _positive(cls, v, info):
        return _pos(v, info.field_name)


class Workload(_Strict):
    batch: Optional[int] = Field(default=None, ge=1, le=1 << 20)
    concurrency: Optional[int] = Field(default=None, ge=1, le=1 << 20)
    rate: Optional[float] = None
    prompt_tokens: Optional[float] = None
    output_tokens: Optional[float] = None
    benchmark: Optional[str] = Field(default=None, max_length=400)
    local_tokens: Optional[int] = Field(default=None, ge=1, le=1 << 24)

    @field_validator("rate", "prompt_tokens", "output_tokens")
    @classmethod
    def _positive(cls, v, info):
        return _pos(v, info.field_name)


class Point(_Strict):
    id: str = Field(min_length=1, max_length=40)
    role: Literal[ROLES] = "held_out"
    model: Literal[MODELS]
    hardware: str = Field(min_length=1, max_length=40)
    gpus: int = Field(ge=1, le=4096)
    tp: Optional[int] = Field(default=None, ge=1, le=4096)
    ep: Optional[int] = Field(default=None, ge=1, le=4096)
    dtype: Literal[DTYPES]
    software: str = Field(min_length=1, max_length=400)
    serving_class: Optional[Literal[SERVING_CLASSES]] = None
    executor: Optional[Literal["dense", "epoch"]] = None
    decoding: Decoding = Field(default_factory=Decoding)
    workload: Workload = Field(default_factory=Workload)
    metric: Literal[METRICS]
    value: Union[float, tuple[float, float]]
    source: str = Field(min_length=1, max_length=1000)
    confidence: Literal["T", "F", "P", "S"] = "T"

    @field_validator("hardware")
    @classmethod
    def _known_hardware(cls, v):
        if v.lower() not in _hw.PROFILES:
            raise ValueError(f"unknown hardware {v!r} (allowed: {', '.join(_hw.PROFILES)})")
        return v.lower()

    @field_validator("value")
    @classmethod
    def _finite(cls, v):
        vals = v if isinstance(v, tuple) else (v,)
        if not all(math.isfinite(x) and x > 0 for x in vals):
            raise ValueError(f"value must be positive and finite, got {v!r}")
        if isinstance(v, tuple) and v[0] > v[1]:
            raise ValueError(f"value range {list(v)}: low > high")
        return v

    @model_validator(mode="after")
    def _parallel_fits(self):
        for k in ("tp", "ep"):
            x = getattr(self, k)
            if x is not None and x > self.gpus:
                raise ValueError(f"{k}={x} exceeds gpus={self.gpus}")
        return self

    @property
    def klass(self) -> str:
        """The serving class: the point's own, else inferred from `software`."""
        return self.serving_class or infer_class(self.software)

    @property
    def path(self) -> str:
        if self.executor:
            return self.executor
        s = self.software.strip().lower()
        return "epoch" if s.startswith("epoch") and "baseline" not in s else "dense"

    @property
    def low_high(self) -> tuple[float, float]:
        return self.value if isinstance(self.value, tuple) else (self.value, self.value)


def infer_class(software: str) -> str:
    """A serving class from the `software` text (a point without `serving_class`)."""
    s = software.lower()
    if "llama.cpp" in s or "llama-diffusion" in s:
        return "llama.cpp"
    if "epoch" in s:
        return "epoch-paper"
    if "replay" in s or "naive all-to-all" in s:
        return "moe-replay"
    return "engine"


class PublishedFile(_Strict):
    about: Optional[str] = Field(default=None, max_length=4000)
    points: list[Point] = Field(min_length=1, max_length=10_000)

    @model_validator(mode="after")
    def _unique_ids(self):
        seen = set()
        for p in self.points:
            if p.id in seen:
                raise ValueError(f"duplicate point id {p.id!r}")
            seen.add(p.id)
        return self


def load(path: str | None = None) -> PublishedFile:
    """Read and validate a published-measurements file (default: the project's). One clear error on bad input."""
    from dblock.errors import ConfigError
    path = path or DATA_PATH
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not JSON ({e})") from None
    try:
        return PublishedFile.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = _where(raw, err.get("loc", ()))
        raise ConfigError(f"{path}: {where}: {err.get('msg')}") from None


def _where(raw, loc) -> str:
    """`points[3] (id 'X1').decoding.tpf` from a pydantic error location."""
    out, node = "", raw
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            try:
                node = node[part]
                if isinstance(node, dict) and "id" in node:
                    out += f" (id {node['id']!r})"
            except (IndexError, KeyError, TypeError):
                pass
        else:
            out += f".{part}" if out else str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return out or "file"
