"""Per-request sampling and stopping parameters (docs/algorithms.md §2.4, §2.6), torch-free.

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
