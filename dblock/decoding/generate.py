"""`generate(requests) -> tokens + counters`: the library entry behind `dblock generate`.

Sampling and stops (docs/algorithms.md §2.4, §2.6) come from the DecodeConfig, or per request from
`Request.sampling`. `DecodeConfig.n` > 1 decodes every prompt n times with seeds seed, seed + 1, ... (a Request's
own seed likewise); the results are prompt-major (prompt 0's n samples, then prompt 1's...), `GenerateResult.samples`
groups them.

Counters (docs/counters.md), summed over requests: Y valid tokens, K blocks, F denoising passes, Q serving passes,
TPF = ΣY/ΣQ; T_den = mean wall time of a denoising call (a batched call counts once); TPS = ΣY / denoising wall
time; wall TPS = ΣY / whole wall time (host overhead, prefill and appends included).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from dblock import families
from dblock.decoding.params import DecodeConfig
from dblock.forward import Forward
from dblock.decoding.schedules import Request, RequestRun, RunTimes, ScheduleSpec, drive, schedule_spec
from dblock.trace import NULL_TRACE, TraceWriter


def reference_forward(model) -> Forward:
    """The readable dense executor for a loaded model of any family (dblock/families.py)."""
    return families.reference_forward(model)


@dataclass
class GenerateResult:
    tokens: list                       # per request: generated ids up to and including the first stop
    counters: list                     # per request: Counters
    times: RunTimes
    runs: list = field(default_factory=list, repr=False)
    n: int = 1                         # samples per prompt (DecodeConfig.n): tokens are prompt-major

    def samples(self, i: int) -> list:
        """The n outputs of prompt i."""
        return self.tokens[i * self.n:(i + 1) * self.n]

    @property
    def finish_reasons(self) -> list:
        """Per request: "stop" (EOS, stop id, stop sequence) or "length"."""
        return [r.finish_reason for r in self.runs]

    @property
    def stop_reasons(self) -> list:
        """Per request: the stopping token id or stop sequence, None when it ran out of budget."""
        return [r.stop_reason for r in self.runs]

    def summary(self) -> dict:
        Y = sum(c.Y for c in self.counters)
        K = sum(c.K for c in self.counters)
        F = sum(c.F for c in self.counters)
        Q = sum(c.Q for c in self.counters)
        t = self.times
        return {
            "requests": len(self.counters), "Y": Y, "K": K, "F": F, "Q": Q,
            "TPF": Y / Q if Q else 0.0,
            "passes_per_block": F / K if K else 0.0,
            "denoise_calls": t.den_calls, "append_calls": t.app_calls,
            "T_den_ms": 1e3 * t.den_s / t.den_calls if t.den_calls else 0.0,
            "TPS": Y / t.den_s if t.den_s else 0.0,
            "wall_TPS": Y / t.wall_s if t.wall_s else 0.0,
            "T_den_cpu_ms": 1e3 * t.den_cpu_s / t.den_calls if t.den_calls else 0.0,
            "TPS_cpu": Y / t.den_cpu_s if t.den_cpu_s else 0.0,
            "wall_s": t.wall_s,
            **self._transformers_tpf(),
        }

    def _transformers_tpf(self) -> dict:
        """DiffusionGemma only: transformers' own TPF (non-pad tokens of committed canvases / denoising passes)
        beside ours, so users can compare with `model.generate` outputs."""
        if not self.runs or self.runs[0].cfg.family != "diffusion_gemma":
            return {}
        from dblock.decoding.entropy_bound import transformers_tpf
        pad = self.runs[0].cfg.pad_token_id
        tokens = sum(len(r.generated) if pad is None else sum(1 for t in r.generated if t != pad) for r in self.runs)
        F = sum(r.counters.F for r in self.runs)
        return {"TPF_transformers": tokens / F if F else 0.0,
                "TPF_transformers_per_request": [transformers_tpf(r.generated, r.counters.F, pad)
                                                 for r in self.runs]}


def as_requests(prompts: Sequence, max_new_tokens: int, seed: int = 0, seeds: Optional[Sequence[int]] = None,
                n: int = 1):
    """Prompts (token-id lists or Requests) -> Requests; with n > 1 each one n times, seeds s, s + 1, ...
    (ids i·n + j for plain prompts, (id, j) for Requests with an id)."""
    reqs = []
    for i, p in enumerate(prompts):
        if isinstance(p, Request):
            if n == 1:
                reqs.append(p)
            else:
                reqs += [dataclasses.replace(p, seed=int(p.seed) + j, id=(p.id, j) if p.id is not None else i * n + j)
                         for j in range(n)]
            continue
        s = seeds[i] if seeds is not None else seed
        reqs += [Request(prompt=list(p), max_new_tokens=max_new_tokens, seed=int(s) + j, id=i * n + j)
                 for j in range(n)]
    return reqs


def generate(model_or_forward: Any, prompts: Sequence, dec: Optional[DecodeConfig] = None,
             schedule: str | ScheduleSpec = "native", trace: TraceWriter = NULL_TRACE, progress: bool = False,
             seeds: Optional[Sequence[int]] = None, batch_size: Optional[int] = None) -> GenerateResult:
    """Decode every prompt (a list of token ids, or a Request) and return tokens and counters.

    `model_or_forward`: a loaded model (the reference executor is used) or any Forward.
    `batch_size`: run at most this many requests at once (default: all together).
    """
    dec = (dec or DecodeConfig()).validate()
    fwd = model_or_forward if isinstance(model_or_forward, Forward) else reference_forward(model_or_forward)
    spec = schedule if isinstance(schedule, ScheduleSpec) else schedule_spec(schedule)
    reqs = as_requests(prompts, dec.max_new_tokens, dec.seed, seeds, dec.n)
    runs = [RequestRun(r, fwd, spec, dec) for r in reqs]  # validates every prompt before any compute
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(r.last_block - r.first_block + 1 for r in runs), unit="block", desc="generate",
                   leave=False)
    total = RunTimes()
    step = batch_size or len(runs)
    with torch.no_grad():
        for i in range(0, len(runs), step):
            t = drive(runs[i:i + step], fwd, trace, bar)
            for k in vars(total):
                setattr(total, k, getattr(total, k) + getattr(t, k))
    if bar is not None:
        bar.close()
    return GenerateResult([r.output_tokens() for r in runs], [r.counters for r in runs], total, runs, dec.n)
