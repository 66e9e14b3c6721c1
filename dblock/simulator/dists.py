"""Small random distributions with a one-line text form, for CLI flags and workload descriptions.

    const:V              always V
    uniform:A,B          uniform on [A, B]
    poisson:MEAN         Poisson
    geometric:MEAN       geometric on {1, 2, ...} with that mean
    gamma:MEAN,CV        gamma with mean MEAN and coefficient of variation CV (cv 0 = const)
    lognormal:MEAN,CV    log-normal with that mean and coefficient of variation
    empirical:V1,V2,...  resample the listed values

Every sampler takes a `numpy.random.Generator`, so runs are reproducible from one seed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

KINDS = ("const", "uniform", "poisson", "geometric", "gamma", "lognormal", "empirical")


@dataclass(frozen=True)
class Dist:
    kind: str
    params: tuple = field(default_factory=tuple)

    @staticmethod
    def parse(text: "str | float | int | Dist") -> "Dist":
        """Parse 'kind:a,b' (a bare number means const). Bad input raises ValueError naming the text."""
        if isinstance(text, Dist):
            return text
        if isinstance(text, (int, float)):
            return Dist("const", (float(text),))
        s = str(text).strip()
        kind, _, rest = s.partition(":")
        if not rest:
            try:
                return Dist("const", (float(kind),))
            except ValueError:
                raise ValueError(f"distribution {s!r}: expected kind:params with kind in {', '.join(KINDS)}") from None
        if kind not in KINDS:
            raise ValueError(f"distribution {s!r}: unknown kind {kind!r} (allowed: {', '.join(KINDS)})")
        try:
            params = tuple(float(x) for x in rest.split(","))
        except ValueError:
            raise ValueError(f"distribution {s!r}: parameters must be numbers") from None
        need = {"const": 1, "uniform": 2, "poisson": 1, "geometric": 1, "gamma": 2, "lognormal": 2}
        if kind in need and len(params) != need[kind]:
            raise ValueError(f"distribution {s!r}: {kind} takes {need[kind]} parameter(s)")
        d = Dist(kind, params)
        d._validate(s)
        return d

    def _validate(self, s: str) -> None:
        p = self.params
        if self.kind == "uniform" and p[1] < p[0]:
            raise ValueError(f"distribution {s!r}: uniform needs A <= B")
        if self.kind in ("poisson", "geometric", "gamma", "lognormal") and p[0] <= 0:
            raise ValueError(f"distribution {s!r}: the mean must be positive")
        if self.kind == "geometric" and p[0] < 1:
            raise ValueError(f"distribution {s!r}: a geometric on 1, 2, ... has mean >= 1")
        if self.kind in ("gamma", "lognormal") and p[1] < 0:
            raise ValueError(f"distribution {s!r}: the coefficient of variation must be >= 0")
        if self.kind == "empirical" and not p:
            raise ValueError(f"distribution {s!r}: empirical needs at least one value")

    @property
    def mean(self) -> float:
        p = self.params
        if self.kind == "uniform":
            return (p[0] + p[1]) / 2
        if self.kind == "empirical":
            return float(np.mean(p))
        return p[0]

    def sample(self, rng: np.random.Generator, size: int | None = None):
        p = self.params
        k = self.kind
        if k == "const":
            out = np.full(size or 1, p[0], dtype=float)
        elif k == "uniform":
            out = rng.uniform(p[0], p[1], size or 1)
        elif k == "poisson":
            out = rng.poisson(p[0], size or 1).astype(float)
        elif k == "geometric":
            out = rng.geometric(1.0 / p[0], size or 1).astype(float)
        elif k == "gamma":
            if p[1] == 0:
                out = np.full(size or 1, p[0], dtype=float)
            else:
                shape = 1.0 / p[1] ** 2
                out = rng.gamma(shape, p[0] / shape, size or 1)
        elif k == "lognormal":
            s2 = math.log(1.0 + p[1] ** 2)
            out = rng.lognormal(math.log(p[0]) - s2 / 2, math.sqrt(s2), size or 1)
        else:  # empirical
            out = rng.choice(np.asarray(p, dtype=float), size or 1)
        return out if size is not None else float(out[0])

    def __str__(self) -> str:
        return f"{self.kind}:" + ",".join(f"{x:g}" for x in self.params)


def stochastic_round(x: float, rng: np.random.Generator) -> int:
    """floor(x) or floor(x)+1 with the probability that keeps E[result] = x (so expectations stay exact)."""
    f = math.floor(x)
    return int(f + (rng.random() < x - f))
