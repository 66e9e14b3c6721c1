"""Decoding parameters (docs/algorithms.md §2): the batch's `DecodeConfig` and each request's `SamplingParams`,
torch-free.

`DecodeConfig` is how a batch decodes: the step rule and its knobs, the block size, the budgets, and the defaults
every request of the batch starts from. `footprint` is the number of positions a request may ever occupy under it
(the serving engine's admission rule, the CLI's bounds).

`SamplingParams` is what one request may set for itself, like vLLM's `SamplingParams`: the masked families'
token sampler (temperature, top-k, top-p) and the stop conditions (stop token ids, stop sequences, min_tokens,
ignore_eos). A batch's defaults come from `DecodeConfig` (`DecodeConfig.sampling_params()`); a `Request` may carry
its own (`Request.sampling`), so one batch can mix greedy and sampled requests, each with its own stops. The seed
stays on the `Request` (`Request.seed`), the generation budget too (`Request.max_new_tokens`).

The library works on token ids: a stop sequence is a tuple of ids. Strings are the text layer's business (it
tokenizes them; see the serving plumbing). Validation raises `ConfigError` naming the field and its allowed range;
the `check_*` helpers are shared with `DecodeConfig.validate`, which names its own fields.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Iterable

from dblock.errors import ConfigError

MASK_POLICIES = ("exclude", "official", "ineligible")
"""Whether a masked model may predict its MASK id (docs/algorithms.md §2.5)."""

MIN_TEMPERATURE = 1e-4
"""Smallest positive sampling temperature: below it z / T overflows for ordinary logits; use 0 for greedy."""

MAX_TEMPERATURE = 1e4


def is_int(v) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def is_real(v) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def check_temperature(name: str, v) -> float:
    if not is_real(v) or not math.isfinite(v) or not (v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE):
        raise ConfigError(f"{name}={v!r}: allowed 0 (greedy) or a finite number in "
                          f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
    return float(v)


def check_top_p(name: str, v) -> float:
    if not is_real(v) or not math.isfinite(v) or not 0.0 < v <= 1.0:
        raise ConfigError(f"{name}={v!r}: allowed a finite number in (0, 1] (1 = off)")
    return float(v)


def check_top_k(name: str, v) -> int:
    if not is_int(v) or v < 0:
        raise ConfigError(f"{name}={v!r}: allowed an integer >= 0 (0 = off)")
    return int(v)


def check_nonneg_int(name: str, v) -> int:
    if not is_int(v) or v < 0:
        raise ConfigError(f"{name}={v!r}: allowed an integer >= 0")
    return int(v)


def check_bool(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{name}={v!r}: allowed True or False")
    return v


def token_ids(name: str, v) -> tuple:
    """A collection of token ids -> tuple of ints >= 0 (order kept, duplicates dropped)."""
    if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
        raise ConfigError(f"{name}={v!r}: allowed a list of token ids (integers >= 0)")
    out = []
    for t in v:
        if not is_int(t) or t < 0:
            raise ConfigError(f"{name}: token id {t!r} is not an integer >= 0")
        if int(t) not in out:
            out.append(int(t))
    return tuple(out)


def stop_sequences(name: str, v) -> tuple:
    """Stop sequences -> tuple of non-empty tuples of token ids. Each item is a token-id list (or one id, a
    one-token sequence). Strings are refused: the text layer tokenizes them."""
    if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
        raise ConfigError(f"{name}={v!r}: allowed a list of token-id sequences (the text layer tokenizes strings)")
    out = []
    for s in v:
        if is_int(s):
            s = (s,)
        if isinstance(s, (str, bytes)):
            raise ConfigError(f"{name}: {s!r} is a string; the library takes token-id sequences (the text layer "
                              "tokenizes stop strings)")
        if not isinstance(s, Iterable):
            raise ConfigError(f"{name}: {s!r} is not a token-id sequence")
        seq = tuple(s)
        if not seq or not all(is_int(t) and t >= 0 for t in seq):
            raise ConfigError(f"{name}: {s!r} must be a non-empty sequence of token ids (integers >= 0)")
        seq = tuple(int(t) for t in seq)
        if seq not in out:
            out.append(seq)
    return tuple(out)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampler and stop conditions (docs/algorithms.md §2.4, §2.6). Validated on construction.

    temperature     masked families: 0 = greedy (argmax, today's tokens); > 0 samples from softmax(z / T) after
                    top-k and top-p, and the confidence is the sampled token's probability (LLaDA2.0's decoder).
                    DiffusionGemma has its own schedule, `DecodeConfig.temperature = (t_max, t_min)`, and refuses it.
    top_p, top_k    nucleus and top-k filters, applied in that order after the temperature (1.0 / 0 = off).
    stop_token_ids  more ids that end generation like EOS (the id is kept in the output, like EOS).
    stop            token-id sequences that end generation at their first occurrence in the output; the
                    sequence is kept in the output (like EOS) and everything after it is dropped.
    min_tokens      no stop (EOS, stop id or stop sequence) may end the output before this many tokens precede it:
                    EOS and the stop ids are suppressed (logit -inf) on the first `min_tokens` generated positions.
    ignore_eos      the model's EOS does not end generation (stop ids and stop sequences still do).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple = ()
    stop: tuple = ()
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "temperature", check_temperature("temperature", self.temperature))
        set_(self, "top_p", check_top_p("top_p", self.top_p))
        set_(self, "top_k", check_top_k("top_k", self.top_k))
        set_(self, "stop_token_ids", token_ids("stop_token_ids", self.stop_token_ids))
        set_(self, "stop", stop_sequences("stop", self.stop))
        set_(self, "min_tokens", check_nonneg_int("min_tokens", self.min_tokens))
        set_(self, "ignore_eos", check_bool("ignore_eos", self.ignore_eos))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def default_sampler(self) -> bool:
        """Greedy with no filters: what the uniform family (its own sampler) accepts."""
        return self.temperature == 0.0 and self.top_p == 1.0 and self.top_k == 0

    def replace(self, **kw) -> "SamplingParams":
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(kw)
        return SamplingParams(**d)

    def check_request(self, vocab_size: int, max_new_tokens: int, uniform: bool, family: str = "") -> None:
        """What needs the model and the request: ids inside the vocabulary, min_tokens within the budget, and no
        masked-family sampler on a uniform-state model. Raises ConfigError."""
        for t in self.stop_token_ids + tuple(t for s in self.stop for t in s):
            if t >= vocab_size:
                raise ConfigError(f"stop token id {t} outside the vocabulary 0..{vocab_size - 1}")
        if self.min_tokens > max_new_tokens:
            raise ConfigError(f"min_tokens={self.min_tokens}: allowed 0..max_new_tokens={max_new_tokens}")
        if uniform and not self.default_sampler:
            raise ConfigError(f"temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}: the masked "
                              f"families' sampler; {family or 'a uniform-state model'} samples with the entropy-bound "
                              "rule and its temperature schedule (DecodeConfig.temperature = (t_max, t_min)); "
                              "allowed here: temperature 0, top_p 1, top_k 0")


@dataclass
class DecodeConfig:
    """How to decode: step rule, block size, budgets. Defaults follow docs/algorithms.md §2 (the Epoch evaluation decoder)."""

    max_new_tokens: int = 128
    block_size: int | None = None    # None: the model's own (config.json `block_size`, 32 for LLaDA)
    rule: str = "threshold"          # "threshold" | "fixed-k" | "entropy-bound" (uniform-state); docs/algorithms.md §2
    threshold: float = 0.95          # tau of the threshold rule
    max_steps: int = 64              # threshold rule: passes per block before committing the rest by argmax
    steps: int | None = None         # fixed-k: passes per block (default 32); entropy-bound: N steps per block (48)
    no_cache: bool = False           # llada2_moe: recompute the whole prefix every pass ("dInfer without cache")
    seed: int = 0
    # entropy-bound rule (uniform-state, docs/algorithms.md §2.3; transformers' DiffusionGemma defaults)
    entropy_bound: float = 0.1       # b: accept the longest low-entropy prefix with cumsum(H) - H_last <= b
    temperature: tuple = (0.8, 0.4)  # (t_max, t_min): T = t_min + (t_max - t_min) * n / N, n = steps remaining
    stability: int = 1               # stop when the argmax canvas equals the previous `stability` ones ...
    confidence: float = 0.005        # ... and the mean entropy is below this (e_stop)
    # masked rules: upstream parity options (docs/algorithms.md §2.1, §2.5)
    threshold_inclusive: bool = False  # True: commit at conf >= tau (dblock's earlier rule); False: conf > tau (upstream)
    threshold_steps: int | None = None  # LLaDA2.0 `steps`: each pass commits at least the quota k_s (C split over S)
    mask_policy: str = "exclude"     # "exclude" | "official" | "ineligible": may the MASK id be predicted (§2.5)
    # masked-family token sampler (docs/algorithms.md §2.4); a Request may carry its own (Request.sampling)
    sampling_temperature: float = 0.0  # 0 = greedy (argmax); > 0 samples from softmax(z / T) after top-k, top-p
    top_p: float = 1.0               # nucleus filter (1 = off)
    top_k: int = 0                   # top-k filter (0 = off)
    # stop conditions, both families (docs/algorithms.md §2.6); token ids (the text layer tokenizes strings)
    stop_token_ids: tuple = ()       # more ids that end generation like EOS
    stop: tuple = ()                 # token-id sequences ending generation at their first occurrence (kept)
    min_tokens: int = 0              # EOS / stop ids suppressed on the first min_tokens generated positions
    ignore_eos: bool = False         # EOS does not end generation; decode up to max_new_tokens
    n: int = 1                       # generate(): n samples per prompt, seeds seed, seed+1, ... (prompt-major)

    def sampling_params(self):
        """The batch's per-request defaults as `SamplingParams`."""
        return SamplingParams(temperature=self.sampling_temperature, top_p=self.top_p, top_k=self.top_k,
                              stop_token_ids=self.stop_token_ids, stop=self.stop, min_tokens=self.min_tokens,
                              ignore_eos=self.ignore_eos)

    @property
    def n_steps(self) -> int:
        """Steps per block of the rule in use: `steps`, or 32 (fixed-k) / 48 (entropy-bound) when unset."""
        if self.steps is not None:
            return self.steps
        return 48 if self.rule == "entropy-bound" else 32

    def validate(self) -> "DecodeConfig":
        if self.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: must be a positive integer")
        if self.block_size is not None and self.block_size <= 0:
            raise ConfigError(f"block_size={self.block_size}: must be a positive integer")
        if self.rule not in ("threshold", "fixed-k", "entropy-bound"):
            raise ConfigError(f"rule={self.rule!r}: allowed threshold, fixed-k, entropy-bound")
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"threshold={self.threshold}: must lie in (0, 1]")
        if self.max_steps <= 0 or (self.steps is not None and self.steps <= 0):
            raise ConfigError(f"max_steps={self.max_steps}, steps={self.steps}: must be positive integers")
        if self.entropy_bound < 0:
            raise ConfigError(f"entropy_bound={self.entropy_bound}: must be >= 0")
        if len(self.temperature) != 2 or min(self.temperature) <= 0:
            raise ConfigError(f"temperature={self.temperature}: give two positive values t_max,t_min")
        if self.stability < 0 or self.confidence < 0:
            raise ConfigError(f"stability={self.stability}, confidence={self.confidence}: must be >= 0")
        for key in ("entropy_bound", "confidence", "threshold"):
            if not math.isfinite(getattr(self, key)):
                raise ConfigError(f"{key}={getattr(self, key)}: must be finite")
        if not all(math.isfinite(t) for t in self.temperature):
            raise ConfigError(f"temperature={self.temperature}: give two finite positive values t_max,t_min")
        if self.temperature[0] < self.temperature[1]:   # T falls from t_max to t_min (equal: constant)
            raise ConfigError(f"temperature={self.temperature}: t_max must be >= t_min")
        check_bool("threshold_inclusive", self.threshold_inclusive)
        if self.threshold_steps is not None:
            if not is_int(self.threshold_steps) or self.threshold_steps <= 0:
                raise ConfigError(f"threshold_steps={self.threshold_steps!r}: allowed a positive integer or None")
            if self.rule != "threshold":
                raise ConfigError(f"threshold_steps={self.threshold_steps}: the threshold rule's LLaDA2.0 quota; "
                                  f"rule={self.rule!r} (allowed with rule=threshold)")
        if self.mask_policy not in MASK_POLICIES:
            raise ConfigError(f"mask_policy={self.mask_policy!r}: allowed {', '.join(MASK_POLICIES)}")
        check_temperature("sampling_temperature", self.sampling_temperature)
        check_top_p("top_p", self.top_p)
        check_top_k("top_k", self.top_k)
        self.stop_token_ids = token_ids("stop_token_ids", self.stop_token_ids)
        self.stop = stop_sequences("stop", self.stop)
        check_nonneg_int("min_tokens", self.min_tokens)
        if self.min_tokens > self.max_new_tokens:
            raise ConfigError(f"min_tokens={self.min_tokens}: allowed 0..max_new_tokens={self.max_new_tokens}")
        check_bool("ignore_eos", self.ignore_eos)
        if not is_int(self.n) or self.n < 1:
            raise ConfigError(f"n={self.n!r}: allowed an integer >= 1")
        if not is_int(self.seed) or not 0 <= self.seed <= 2 ** 63 - 1:
            raise ConfigError(f"seed={self.seed!r}: allowed an integer in [0, 2**63-1]")
        return self

    def replace(self, **kw) -> "DecodeConfig":
        return dataclasses.replace(self, **kw)


def footprint(prompt_len: int, max_new_tokens: int, block: int, family: str) -> int:
    """Positions a request may ever occupy: prompt + generation budget on its block grid. llada2_moe blocks lie on
    the absolute grid (the prompt's tail shares the first one); the other families put whole blocks after the
    prompt. Used by the serving engine's admission and by the CLI's bounds alike."""
    if family == "llada2_moe":
        return -(-(prompt_len + max_new_tokens) // block) * block
    return prompt_len + -(-max_new_tokens // block) * block
