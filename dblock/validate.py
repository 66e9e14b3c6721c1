"""The one validation layer for model configs, shared by every family (dblock/config.py,
dblock/gemma_config.py).

Each family declares its keys once as `Field`s (type, range, null allowed); `check_keys` applies them to the raw
config.json values (naming the key as the file spells it) and `check_fields` to the config object's fields (for
configs built in code: the tiny presets, `train-tiny`). The rules are strict:

  types     an integer is a JSON integer (not `8.5`, not `8.0`, not `"8"`, not `true`); a number is an integer or
            a float, finite (`NaN`, `Infinity` refused); a boolean is `true`/`false` (not `0`, not `"false"`);
            `null` is allowed only for optional keys, where it means the documented default
  ranges    sizes >= 1 (widths that may be absent >= 0), probabilities and fractions in [0, 1] or (0, 1],
            epsilons and RoPE bases > 0

Cross-field rules (heads divide the hidden size, top-k <= experts, ...) live in each config's `validate()`, which
calls `check_plausible` before any of them: the parameter count and the number of checkpoint tensors, computed in
closed form from the sizes (nothing loops over layers or experts), must stay under a plausibility limit, so a typo
such as `num_hidden_layers: 1000000000` is refused at once instead of building a billion-entry table.

  parameters  <= DBLOCK_MAX_PARAMS if set, else RAM_FACTOR (16) x this machine's RAM / BYTES_PER_PARAM (2, bf16,
              the narrowest dtype dblock loads): generous on purpose -- a real model may be read onto several GPUs
              or inspected with `dblock info` on a smaller machine -- while any typo of a size by orders of
              magnitude is caught
  tensors     <= DBLOCK_MAX_TENSORS if set, else MAX_TENSORS (1,000,000; LLaDA2.0-flash has about 25,000)

Every failure is a `ConfigError` naming the file, the key, the value and what is allowed. Config only: no torch.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from dblock.errors import ConfigError

RAM_FACTOR = 16            # parameter bytes may reach this many times the machine's RAM
BYTES_PER_PARAM = 2        # counted as bf16
MAX_TENSORS = 1_000_000
FALLBACK_RAM = 64 << 30    # when the RAM cannot be read (no psutil, no sysconf)


# ---------------------------------------------------------------------------------------------------------------
# typed, finite, in-range values
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Field:
    """What one config value may be.

    kind: "int" | "float" | "bool" | "str" | "object" (a JSON object / dict) | "list" | "ids" (a token id or a
    non-empty list of them). lo / hi: bounds, inclusive unless lo_open / hi_open. null: None allowed (the key's
    default). choices: allowed strings.
    """

    kind: str
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    null: bool = False
    choices: tuple = ()

    def describe(self) -> str:
        if self.kind in ("int", "ids"):
            if self.lo == 1 and self.hi is None:
                s = "a positive integer"
            elif self.lo == 0 and self.hi is None:
                s = "a non-negative integer"
            else:
                s = "an integer" + _range_text(self)
            if self.kind == "ids":
                s = f"a token id ({s}) or a list of them"
        elif self.kind == "float":
            s = "a finite number" + _range_text(self)
        elif self.kind == "bool":
            s = "true or false"
        elif self.kind == "str":
            s = ", ".join(self.choices) if self.choices else "a string"
        elif self.kind == "object":
            s = "an object"
        elif self.kind == "list":
            s = "a list"
        else:  # pragma: no cover - a typo in a table
            raise AssertionError(self.kind)
        return s + (" or null" if self.null else "")


def _range_text(f: Field) -> str:
    if f.lo is not None and f.hi is not None:
        return f" in {'(' if f.lo_open else '['}{_num(f.lo)}, {_num(f.hi)}{')' if f.hi_open else ']'}"
    if f.lo is not None:
        return f" {'>' if f.lo_open else '>='} {_num(f.lo)}"
    if f.hi is not None:
        return f" {'<' if f.hi_open else '<='} {_num(f.hi)}"
    return ""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# shorthands for the family tables
POS = Field("int", lo=1)                                   # a size
POS_OPT = Field("int", lo=1, null=True)
NONNEG = Field("int", lo=0)
NONNEG_OPT = Field("int", lo=0, null=True)
ID_OPT = Field("int", lo=0, null=True)
IDS_OPT = Field("ids", lo=0, null=True)
POSITIVE_REAL = Field("float", lo=0, lo_open=True)          # rope_theta, scales
POSITIVE_REAL_OPT = Field("float", lo=0, lo_open=True, null=True)
EPS_OPT = Field("float", lo=0, hi=1, lo_open=True, null=True)  # rms_norm_eps
FRACTION = Field("float", lo=0, hi=1, lo_open=True)         # (0, 1]: partial_rotary_factor of LLaDA
FRACTION_OPT = Field("float", lo=0, hi=1, lo_open=True, null=True)
PROB_OPT = Field("float", lo=0, hi=1, null=True)            # [0, 1]
BOOL = Field("bool")
BOOL_OPT = Field("bool", null=True)
STR = Field("str")
OBJECT_OPT = Field("object", null=True)
LIST_OPT = Field("list", null=True)


def json_type(v: Any) -> str:
    """How JSON would name the type of `v`: 'a string', 'an integer', 'null', ..."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number" if math.isfinite(v) else "a non-finite number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, (list, tuple)):
        return "a list"
    return type(v).__name__


def short_repr(v: Any, limit: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def bad_value(source: str, key: str, value: Any, f: Field, why: str = "") -> ConfigError:
    """The one message of a value that breaks its `Field` (the format config errors have always had)."""
    got = f"; got {json_type(value)}" if why == "type" else ""
    return ConfigError(f"{source}: unsupported {key}={short_repr(value)} (allowed: {f.describe()}{got})")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _in_range(v: float, f: Field) -> bool:
    if f.lo is not None and (v <= f.lo if f.lo_open else v < f.lo):
        return False
    if f.hi is not None and (v >= f.hi if f.hi_open else v > f.hi):
        return False
    return True


def check_value(source: str, key: str, value: Any, f: Field) -> Any:
    """`value` if it satisfies `f` (int/float values of a "float" field come back as float), else ConfigError."""
    if value is None:
        if f.null:
            return None
        raise bad_value(source, key, value, f, "type")
    k = f.kind
    if k == "int":
        if not _is_int(value):
            raise bad_value(source, key, value, f, "type")
        if not _in_range(value, f):
            raise bad_value(source, key, value, f)
        return value
    if k == "ids":
        items = value if isinstance(value, (list, tuple)) else [value]
        if not items or not all(_is_int(v) for v in items):
            raise bad_value(source, key, value, f, "type")
        if not all(_in_range(v, f) for v in items):
            raise bad_value(source, key, value, f)
        return value
    if k == "float":
        if not (_is_int(value) or isinstance(value, float)):
            raise bad_value(source, key, value, f, "type")
        try:
            x = float(value)
        except OverflowError:   # an integer beyond float range
            raise bad_value(source, key, value, f) from None
        if not math.isfinite(x) or not _in_range(x, f):
            raise bad_value(source, key, value, f)
        return x
    if k == "bool":
        if not isinstance(value, bool):
            raise bad_value(source, key, value, f, "type")
        return value
    if k == "str":
        if not isinstance(value, str):
            raise bad_value(source, key, value, f, "type")
        if f.choices and value not in f.choices:
            raise bad_value(source, key, value, f)
        return value
    if k == "object":
        if not isinstance(value, dict):
            raise bad_value(source, key, value, f, "type")
        return value
    if k == "list":
        if not isinstance(value, (list, tuple)):
            raise bad_value(source, key, value, f, "type")
        return value
    raise AssertionError(k)  # pragma: no cover


def check_keys(d: dict, fields: dict, source: str, prefix: str = "") -> None:
    """Check every key of `fields` that `d` holds (absent keys are the readers' business: required or default)."""
    for key, f in fields.items():
        if key in d:
            check_value(source, prefix + key, d[key], f)


def check_fields(obj: Any, fields: dict, source: str) -> None:
    """Check the attributes of a config object against `fields`."""
    for key, f in fields.items():
        check_value(source, key, getattr(obj, key), f)


def read_json(path: str) -> Any:
    """The parsed JSON of `path`, any JSON value (callers that need an object say so with `require_object`);
    ConfigError naming the file when it is missing, unreadable or not JSON."""
    import json
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (not UTF-8 text: {e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid JSON (nested too deeply)") from None
    except OSError as e:  # a folder named config.json, no permission, an I/O error
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None


def require_object(d: Any, source: str, what: str = "the model's keys") -> dict:
    """`d` if it is a JSON object, else a ConfigError naming the file (a list or a scalar where an object belongs)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: holds {json_type(d)} ({short_repr(d, 40)}), expected a JSON object with "
                          f"{what}")
    return d


def opt(d: dict, key: str, default: Any) -> Any:
    """d[key], or `default` when the key is absent or null (null means the default)."""
    v = d.get(key)
    return default if v is None else v


# ---------------------------------------------------------------------------------------------------------------
# plausibility: parameters and tensors, before anything is built
# ---------------------------------------------------------------------------------------------------------------

def ram_bytes() -> int:
    """This machine's physical memory (psutil when installed, else sysconf; FALLBACK_RAM when neither works)."""
    try:
        import psutil
        return int(psutil.virtual_memory().total)
    except Exception:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return FALLBACK_RAM


def _env_limit(name: str) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not math.isfinite(v) or v < 1:
        raise ConfigError(f"environment variable {name}={raw!r}: expected a positive number (e.g. 2e11)")
    return int(v)


def param_limit() -> tuple:
    """(max parameters, how the limit was set)."""
    env = _env_limit("DBLOCK_MAX_PARAMS")
    if env is not None:
        return env, "DBLOCK_MAX_PARAMS"
    ram = ram_bytes()
    return ram * RAM_FACTOR // BYTES_PER_PARAM, (f"{RAM_FACTOR} x this machine's {ram / 2 ** 30:.1f} GiB RAM at "
                                                 f"{BYTES_PER_PARAM} bytes per parameter; set DBLOCK_MAX_PARAMS "
                                                 "to change it")


def tensor_limit() -> tuple:
    env = _env_limit("DBLOCK_MAX_TENSORS")
    if env is not None:
        return env, "DBLOCK_MAX_TENSORS"
    return MAX_TENSORS, "set DBLOCK_MAX_TENSORS to change it"


# The largest value each size takes in real models of these families, rounded up (LLaDA2.0-flash, DiffusionGemma,
# their relatives). The key furthest above its entry is the one an implausible config is blamed on.
TYPICAL_MAX = {
    "num_hidden_layers": 128, "num_experts": 512, "hidden_size": 16384, "vocab_size": 262144,
    "moe_intermediate_size": 4096, "intermediate_size": 65536, "num_attention_heads": 128,
    "num_key_value_heads": 128, "head_dim": 512, "global_head_dim": 512, "num_global_key_value_heads": 128,
    "num_shared_experts": 8,
}


def _culprit(sizes: dict, keys: tuple) -> str:
    """The size key whose value is furthest above what real models use (TYPICAL_MAX)."""
    return max(keys, key=lambda k: sizes[k] / TYPICAL_MAX.get(k, 1))


def check_plausible(source: str, sizes: dict, params: Callable[[dict], int], tensors: Callable[[dict], int],
                    keys: tuple) -> None:
    """ConfigError naming the culprit key when the closed-form parameter or tensor count of `sizes` is over its
    limit. `params` / `tensors`: sizes -> count, O(1); `keys`: the size keys that may be blamed (`_culprit`)."""
    n, (limit, how) = params(sizes), param_limit()
    if n > limit:
        k = _culprit(sizes, keys)
        raise ConfigError(f"{source}: implausible {k}={short_repr(sizes[k])}: the model would have {n:.3g} "
                          f"parameters ({n * BYTES_PER_PARAM:.3g} bytes in bf16), over the limit of {limit:.3g} "
                          f"parameters ({how})")
    n, (limit, how) = tensors(sizes), tensor_limit()
    if n > limit:
        k = _culprit(sizes, keys)
        raise ConfigError(f"{source}: implausible {k}={short_repr(sizes[k])}: the checkpoint would hold {n:,} "
                          f"tensors, over the limit of {limit:,} ({how})")


# ---- closed-form counts of the families (tests compare them with the families' slot tables) ----------------------

LLADA_SIZE_KEYS = ("num_hidden_layers", "num_experts", "hidden_size", "vocab_size", "moe_intermediate_size",
                   "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "num_shared_experts")


def llada_params(s: dict) -> int:
    """Parameters of a LLaDA model (the tensors of `dblock.reference.llada_weights.slots`) from its sizes."""
    V, H, L, N, G, D = (s["vocab_size"], s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"],
                        s["num_key_value_heads"], s["head_dim"])
    E, I, Id, S = s["num_experts"], s["moe_intermediate_size"], s["intermediate_size"], s["num_shared_experts"]
    n_dense = min(max(s["first_k_dense_replace"], 0), L)
    attn = (N * D + 2 * G * D) * H + H * N * D + (2 * D if s["use_qk_norm"] else 0) + 2 * H
    moe = E * H + (E if s["use_expert_bias"] else 0) + 3 * E * I * H + 3 * I * S * H
    return 2 * V * H + H + L * attn + n_dense * 3 * Id * H + (L - n_dense) * moe


def llada_tensors(s: dict) -> int:
    """HF tensors of a LLaDA checkpoint (one per routed expert and projection) from its sizes."""
    L = s["num_hidden_layers"]
    n_dense = min(max(s["first_k_dense_replace"], 0), L)
    qkv = 1 if s["family"] == "llada2_moe" else 3
    per_layer = 2 + qkv + 1 + (2 if s["use_qk_norm"] else 0)
    moe = 1 + (1 if s["use_expert_bias"] else 0) + 3 * s["num_experts"] + (3 if s["num_shared_experts"] else 0)
    return 3 + L * per_layer + n_dense * 3 + (L - n_dense) * moe


GEMMA_SIZE_KEYS = ("num_hidden_layers", "num_experts", "hidden_size", "vocab_size", "moe_intermediate_size",
                   "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
                   "num_global_key_value_heads")


def _gemma_layers(s: dict) -> tuple:
    L = s["num_hidden_layers"]
    n_full = min(max(s["n_full"], 0), L)
    return L - n_full, n_full


def gemma_params(s: dict) -> int:
    """Parameters a DiffusionGemma model holds (`dblock.reference.gemma_weights.slots` less the encoder copies)."""
    V, H, N, E, I, Id = (s["vocab_size"], s["hidden_size"], s["num_attention_heads"], s["num_experts"],
                         s["moe_intermediate_size"], s["intermediate_size"])
    n_sliding, n_full = _gemma_layers(s)

    def layer(D, G, v):
        attn = N * D * H + G * D * H * (2 if v else 1) + H * N * D + 2 * D
        return 7 * H + attn + 3 * Id * H + E * H + H + E + 3 * E * I * H + 2   # + the two layer scalars

    top = V * H + H + H + 3 * Id * H + (0 if s["tie_word_embeddings"] else V * H)
    return (top + n_sliding * layer(s["head_dim"], s["num_key_value_heads"], True)
            + n_full * layer(s["global_head_dim"], s["num_global_key_value_heads"], False))


def gemma_tensors(s: dict) -> int:
    n_sliding, n_full = _gemma_layers(s)
    shared = 7 + 3 + 2 + 3 + 3 + 2                   # norms, q/k/o, q/k norm, MLP, router, experts
    copies = 1 if s["tie_word_embeddings"] else 2     # untied: the encoder's copies are written too
    per = (n_sliding * (shared + 1) + n_full * shared) * copies + 2 * (n_sliding + n_full)
    return 2 + 4 + per + (0 if s["tie_word_embeddings"] else 3)
