"""Profiled operator cost model: what each operator of a pass costs on one machine, measured, then interpolated.

`dblock simulate profile` (dblock/profiling/profiler.py) times every operator of a pass of one model on this
machine over a grid of shapes, each grid point `repeats` times with the calling thread's CPU time
(`time.thread_time`), and writes a JSON `Profile`. This module reads it (numpy and scipy only, no torch) and prices a
call from its shape (`CallShape`) by interpolating the operators.

Operators (one table each; `per` says what one value is):

    attention(requests, rows, context)   one layer's attention sub-block (norm, QKV, RoPE, softmax over `context`
                                 keys per query, output projection, residual) for `requests` requests of `rows`
                                 (padded) query rows each: on a CPU the scores grow with requests·rows·context and
                                 the key/value concatenation and head expansion with requests·context, so both
                                 splits are measured
    dense_mlp(rows)              one dense FFN sub-block (norm, SwiGLU, residual)
    router(rows)                 one MoE layer's router: fp32 logits and the family's top-K rule
    moe(rows, touched)           one MoE layer's routed experts and shared expert, `rows` rows spread evenly over
                                 `touched` experts (rows per expert = rows·K/touched), reference implementation
    lm_head(live)                final norm + LM head for one segment's live rows (executors call it per segment)
    call_denoise(requests, segments)   the fixed cost of one denoising call: the whole call measured minus its
                                 operators (layout and masks, KV stacking, embedding, Python) by requests in the
                                 call and segments per request
    call_append(requests)        the same for a prefill/append call
    driver(requests)             the host work per iteration outside the executor calls (segments in, sampler step
                                 out, commits, the serving engine's bookkeeping)
    admit(requests)              the extra host work of an iteration that admits that many requests (serving)
    epoch_moe(rows, fresh_frac)  the Epoch executor's MoE region of one layer (fresh rows through the experts,
                                 stable decoded rows from its cache, supports, shared expert) over `rows` valid rows
                                 of which `fresh_frac` are fresh; measured from the executor's own passes on
                                 real Native decodes of the model's task (`profiler_epoch.py`: the Atlas's
                                 per-token fail-closed and repair included)
    epoch_call_denoise(requests, segments)   the Epoch executor's fixed cost of a denoising call

Interpolation: one axis, `scipy.interpolate.interp1d` (linear, extrapolated linearly beyond the grid); more axes,
`scipy.interpolate.RegularGridInterpolator` (multilinear, extrapolated). Before interpolating, every axis along which
the operator is monotone (`OpTable.monotone`) is made non-decreasing (a running maximum over the grid), so a
measured table whose noise dips keeps the operator's monotonicity, and multilinear interpolation of monotone grid
values is monotone. On grid points the interpolation returns the (monotone) table value exactly. Values are clipped
at 0.

Drift: a shared machine runs at a different speed from one hour to the next even in CPU time (clock, shared
caches). The profile stores a few anchor timings (`Profiler.anchors`); whoever uses it later re-times them
(`profiler.drift`, about a second) and passes the median ratio as `ProfiledCost(scale=...)` — one factor, measured on
microbenchmarks, never fitted on a decoding run.

Uncertainty: each grid point keeps the median and the 25th/75th percentiles of its repeats (`median`, `lo`, `hi`);
`ProfiledCost(profile, q="lo"|"median"|"hi")` prices with one of them, so a prediction made three times gives an
interval from the profile's repeat spread (all operators at the same quantile: machine drift moves them together).

The roofline (`cost.py`) stays for hardware that cannot be measured here (H100, GB300); `RooflineCost` prices a
`CallShape` with it behind the same interface, and a profile measured on a GPU loads in place of a CPU one.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

PROFILE_VERSION = 1
TIMER = "time.thread_time (CPU time of the calling thread)"
QUANTILES = ("lo", "median", "hi")
PROFILE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "dblock", "profiles")


def default_path(model: str, machine_tag: str | None = None) -> str:
    """Where `dblock simulate profile --model M` writes (and the demo and `validate` look) by default."""
    name = os.path.basename(os.path.normpath(model)) or "model"
    return os.path.join(PROFILE_DIR, f"{name}{'-' + machine_tag if machine_tag else ''}.json")


@dataclass
class OpTable:
    """One operator's measured cost over a regular grid (seconds per `per`)."""

    name: str
    axes: list
    grid: list                       # one ascending list of grid values per axis
    median: np.ndarray               # shape: one entry per grid point
    lo: np.ndarray                   # 25th percentile of the repeats
    hi: np.ndarray                   # 75th percentile
    monotone: list                   # per axis: the operator does not get cheaper along it
    per: str = "call"
    repeats: int = 0
    note: str = ""
    _interp: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        self.grid = [[float(v) for v in g] for g in self.grid]
        shape = tuple(len(g) for g in self.grid)
        for k in QUANTILES:
            a = np.asarray(getattr(self, k), dtype=float).reshape(shape)
            if not np.all(np.isfinite(a)):
                raise ValueError(f"profile table {self.name}: {k} has non-finite values")
            setattr(self, k, a)
        if len(self.axes) != len(self.grid) or len(self.monotone) != len(self.grid):
            raise ValueError(f"profile table {self.name}: axes, grid and monotone differ in length")
        for ax, g in zip(self.axes, self.grid):
            if len(g) < 1 or any(b <= a for a, b in zip(g, g[1:])):
                raise ValueError(f"profile table {self.name}: grid of {ax} must be strictly ascending")
        # a quantile band always contains the median
        self.lo = np.minimum(self.lo, self.median)
        self.hi = np.maximum(self.hi, self.median)

    def envelope(self, q: str = "median") -> np.ndarray:
        """The table values made non-decreasing along every monotone axis (running maximum)."""
        v = np.array(getattr(self, q), dtype=float)
        for i, mono in enumerate(self.monotone):
            if mono:
                v = np.maximum.accumulate(v, axis=i)
        return v

    def _interpolator(self, q: str):
        f = self._interp.get(q)
        if f is not None:
            return f
        from scipy.interpolate import RegularGridInterpolator, interp1d
        vals = self.envelope(q)
        if len(self.grid) == 1:
            g = np.asarray(self.grid[0])
            if g.size == 1:
                const = float(vals[0])
                f = (lambda x: np.full(np.shape(x), const))   # noqa: E731
            else:
                f = interp1d(g, vals, kind="linear", fill_value="extrapolate", assume_sorted=True)
        else:
            pts = []
            keep = []
            for i, g in enumerate(self.grid):
                if len(g) > 1:
                    pts.append(np.asarray(g))
                    keep.append(i)
            if not keep:                                  # every axis a single point: a constant
                const = float(vals.reshape(-1)[0])

                def f(*x, _c=const):
                    return np.asarray([_c])
            elif len(keep) == 1:                          # one axis varies: 1-D linear
                i0 = keep[0]
                g1 = interp1d(np.asarray(self.grid[i0]), vals.reshape(-1), kind="linear", fill_value="extrapolate",
                              assume_sorted=True)

                def f(*x, _g=g1, _i=i0):
                    return np.asarray([_g(x[_i])])
            else:
                sq = vals.reshape([len(g) for g in self.grid if len(g) > 1])
                rgi = RegularGridInterpolator(pts, sq, method="linear", bounds_error=False, fill_value=None)

                def f(*x, _rgi=rgi, _keep=keep):
                    return _rgi(np.asarray([[x[i] for i in _keep]], dtype=float))
        self._interp[q] = f
        return f

    def __call__(self, *x: float, q: str = "median") -> float:
        if len(x) != len(self.axes):
            raise ValueError(f"{self.name}({', '.join(self.axes)}): got {len(x)} coordinates")
        if q not in QUANTILES:
            raise ValueError(f"q={q!r}: allowed {', '.join(QUANTILES)}")
        f = self._interpolator(q)
        v = f(float(x[0])) if len(self.grid) == 1 else f(*[float(v) for v in x])
        return max(0.0, float(np.asarray(v).reshape(-1)[0]))

    def as_dict(self) -> dict:
        return dict(name=self.name, axes=list(self.axes), grid=self.grid, median=self.median.tolist(),
                    lo=self.lo.tolist(), hi=self.hi.tolist(), monotone=list(self.monotone), per=self.per,
                    repeats=self.repeats, note=self.note)

    @staticmethod
    def from_dict(d: dict) -> "OpTable":
        return OpTable(d["name"], list(d["axes"]), d["grid"], np.asarray(d["median"]), np.asarray(d["lo"]),
                       np.asarray(d["hi"]), list(d["monotone"]), d.get("per", "call"), int(d.get("repeats", 0)),
                       d.get("note", ""))

    @staticmethod
    def from_samples(name: str, axes: Sequence[str], grid: Sequence[Sequence[float]], samples: np.ndarray,
                     monotone: Sequence[bool], per: str = "call", note: str = "") -> "OpTable":
        """`samples`: shape grid + (repeats,), seconds; the median and quartiles over the last axis."""
        s = np.asarray(samples, dtype=float)
        return OpTable(name, list(axes), [list(g) for g in grid], np.median(s, axis=-1),
                       np.percentile(s, 25, axis=-1), np.percentile(s, 75, axis=-1), list(monotone), per,
                       int(s.shape[-1]), note)


@dataclass
class Profile:
    """Every operator table of one model on one machine, with what was measured where (`meta`)."""

    meta: dict
    tables: dict
    source: str = field(default="", compare=False)     # where it was read from (for messages)

    def __getitem__(self, name: str) -> OpTable:
        try:
            return self.tables[name]
        except KeyError:
            raise ValueError(f"profile {getattr(self, 'source', '')}: no {name!r} table (has "
                             f"{', '.join(sorted(self.tables))}); re-run `dblock simulate profile` for this executor") \
                from None

    def has(self, name: str) -> bool:
        return name in self.tables

    @property
    def model(self) -> dict:
        return self.meta.get("model", {})

    def as_dict(self) -> dict:
        return dict(version=PROFILE_VERSION, meta=self.meta,
                    tables={k: t.as_dict() for k, t in sorted(self.tables.items())})

    @staticmethod
    def from_dict(d: dict, where: str = "<profile>") -> "Profile":
        """A profile from its JSON, validated like a config (`check_profile_dict`); errors name `where`."""
        from dblock.errors import InputFileError
        if not isinstance(d, dict) or "tables" not in d or "meta" not in d:
            raise InputFileError(f"{where}: not a dblock operator profile (no meta/tables)")
        if d.get("version") != PROFILE_VERSION:
            raise InputFileError(f"{where}: profile version {str(d.get('version'))[:20]!r}, this dblock reads "
                                 f"{PROFILE_VERSION}; re-run `dblock simulate profile`")
        check_profile_dict(d, where)
        try:
            tables = {k: OpTable.from_dict(t) for k, t in d["tables"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise InputFileError(f"{where}: bad profile table ({e})") from None
        for name, t in tables.items():
            check_table_values(t, where)
        prof = Profile(dict(d["meta"]), tables)
        prof.source = where
        return prof

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.as_dict(), f, indent=1)
        os.replace(tmp, path)

    @staticmethod
    def load(path: str, flag: str | None = None) -> "Profile":
        """The profile in `path` (a JSON file written by `simulate profile`), read as untrusted input
        (`dblock.input_files`); every problem is one InputFileError naming `flag` and the file."""
        from dblock.input_files import read_json, where
        return Profile.from_dict(read_json(path, flag), where(path, flag))


#: tables that are a whole call (or iteration) measured minus its operators: a value may be <= 0 (noise, or nothing
#: left over; priced as 0), though not < 0 everywhere. Every other table is an operator timed on its own: > 0
#: everywhere.
RESIDUAL_TABLES = ("call_denoise", "call_append", "epoch_call_denoise", "driver", "admit")
#: grid points one table may have (checked before its values are read into arrays), seconds one value may be
MAX_TABLE_POINTS = 1 << 20
MAX_SECONDS = 3600.0


def check_profile_dict(d: dict, where: str) -> None:
    """The structure of a profile's JSON (types, finite numbers, sizes) checked before anything is built from it:
    meta.model's sizes are integers in range, each table has names, axes, a strictly ascending finite grid of at most
    `MAX_TABLE_POINTS` points and as many median/lo/hi values. An InputFileError naming `where` and the key."""
    from typing import Annotated, Any, Optional

    from pydantic import BaseModel, ConfigDict, Field, ValidationError

    from dblock.errors import InputFileError
    from dblock.input_files import validation_message

    def Int(lo, hi):
        return Annotated[int, Field(strict=True, ge=lo, le=hi)]
    Num = Annotated[float, Field(strict=True, allow_inf_nan=False)]

    class Model(BaseModel):
        model_config = ConfigDict(extra="allow")
        name: Optional[str] = None
        family: str = "?"
        num_hidden_layers: Int(1, 1 << 16)
        n_moe_layers: Int(0, 1 << 16)
        num_experts: Int(0, 1 << 20)
        num_experts_per_tok: Int(0, 1 << 20)
        block_size: Int(0, 1 << 16) = 0

    class Meta(BaseModel):
        model_config = ConfigDict(extra="allow")
        model: Optional[Model] = None            # what pricing needs (`ProfiledCost` names it when absent)

    class Table(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str
        axes: Annotated[list[str], Field(min_length=1, max_length=8)]
        grid: Annotated[list[Annotated[list[Num], Field(min_length=1, max_length=1 << 16)]],
                        Field(min_length=1, max_length=8)]
        median: Any
        lo: Any
        hi: Any
        monotone: list[Annotated[bool, Field(strict=True)]]
        per: str = "call"
        repeats: Int(0, 1 << 20) = 0
        note: str = ""

    class Doc(BaseModel):
        model_config = ConfigDict(extra="allow")
        version: int
        meta: Meta
        tables: Annotated[dict[str, Table], Field(min_length=1, max_length=256)]

    try:
        doc = Doc.model_validate(d)
    except ValidationError as e:
        raise InputFileError(f"{where}: {validation_message(e)}") from None
    for name, t in doc.tables.items():
        points = math.prod(len(g) for g in t.grid)
        if points > MAX_TABLE_POINTS:
            raise InputFileError(f"{where}: table {name}: {points:,} grid points, beyond {MAX_TABLE_POINTS:,}")
        if len(t.axes) != len(t.grid) or len(t.monotone) != len(t.grid):
            raise InputFileError(f"{where}: table {name}: axes, grid and monotone differ in length")
        for q in QUANTILES:
            n = _count_numbers(getattr(t, q), points, len(t.grid))
            if n != points:
                raise InputFileError(f"{where}: table {name}: {q} has {n} values for {points} grid points")
    m = doc.meta.model
    if m is not None and (m.n_moe_layers > m.num_hidden_layers or m.num_experts_per_tok > m.num_experts):
        raise InputFileError(f"{where}: meta.model: n_moe_layers {m.n_moe_layers} of {m.num_hidden_layers} layers, "
                             f"top-{m.num_experts_per_tok} of {m.num_experts} experts: inconsistent")


def _count_numbers(v, limit: int, depth: int) -> int:
    """How many numbers a nested list of at most `depth` levels holds (a ValueError-free count: anything that is
    not a JSON number, too deep or more than `limit` values returns -1)."""
    stack, n = [(v, 0)], 0
    while stack:
        x, d = stack.pop()
        if isinstance(x, list) and d < depth:
            stack.extend((y, d + 1) for y in x)
        elif isinstance(x, (int, float)) and not isinstance(x, bool) and d == depth:
            n += 1
            if n > limit:
                return -1
        else:
            return -1
    return n


def check_table_values(t: "OpTable", where: str) -> None:
    """A table's times are seconds: finite (checked by OpTable), at most `MAX_SECONDS`, an operator's > 0 at every
    grid point (an operator that costs nothing is not a measurement, and would price its calls as free), a residual
    table's (`RESIDUAL_TABLES`) not < 0 everywhere."""
    from dblock.errors import InputFileError
    for q in QUANTILES:
        a = getattr(t, q)
        if np.abs(a).max(initial=0.0) > MAX_SECONDS:
            raise InputFileError(f"{where}: table {t.name}: {q} has {float(np.abs(a).max()):g} s, beyond "
                                 f"{MAX_SECONDS:g} s for one operator")
    if t.name in RESIDUAL_TABLES:
        if (t.median < 0).all():
            raise InputFileError(f"{where}: table {t.name}: every median time < 0 (max {float(t.median.max()):g} s): "
                                 "not a measurement")
    elif not (t.median > 0).all() or not (t.lo >= 0).all():
        bad = float(min(t.median.min(), t.lo.min()))
        raise InputFileError(f"{where}: table {t.name}: a time <= 0 ({bad:g} s); an operator's measured times are "
                             "> 0 (re-run `dblock simulate profile`)")


# ---- pricing a call ---------------------------------------------------------------------------------------------

@dataclass
class CallShape:
    """What a batched executor call carries, as the cost model sees it.

    The reference executor pads every request of a call to the longest one: `rows` is that padded row count per
    request and `context` the padded keys each query sees (longest cache + rows). `segments` is the number of
    segments per request (one LM-head call each on the denoising path); `live` lists the live rows of every
    segment that returns logits. `valid_rows` are the rows without padding (the Epoch executor routes only those);
    `fresh_frac` is the share of them that go through the routed experts (1 on the dense path).
    """

    kind: str = "denoise"              # denoise | append
    requests: int = 1
    rows: int = 16
    context: float = 16.0
    segments: int = 1
    live: tuple = ()
    valid_rows: int | None = None
    fresh_frac: float = 1.0

    def __post_init__(self):
        if self.kind not in ("denoise", "append"):
            raise ValueError(f"CallShape.kind={self.kind!r}: allowed denoise, append")
        if self.requests < 1 or self.rows < 1:
            raise ValueError(f"CallShape: requests={self.requests}, rows={self.rows} must be >= 1")
        self.live = tuple(int(x) for x in self.live)
        if self.valid_rows is None:
            self.valid_rows = self.requests * self.rows

    @property
    def padded_rows(self) -> int:
        return self.requests * self.rows

    def stripped(self, rows: int, live: Sequence[int], segments: int = 1) -> "CallShape":
        """The same requests with fewer in-flight rows per request (e.g. OBA's warm-up half removed)."""
        return CallShape(self.kind, self.requests, rows, self.context - self.rows + rows, segments, tuple(live),
                         None, self.fresh_frac)


def touched_experts(rows: float, E: int, K: int) -> float:
    """Expected distinct experts that receive at least one of `rows` rows when each row picks K of E uniformly:
    E·(1 − (1 − K/E)^rows). Real routers are skewed (fewer touched); the profile's `moe` table is read at this
    count."""
    if rows <= 0 or E <= 0:
        return 0.0
    return E * (1.0 - (1.0 - min(1.0, K / E)) ** rows)


class ProfiledCost:
    """Price calls with a measured `Profile` (`executor`: reference = the dense path, epoch = the Epoch executor)."""

    def __init__(self, profile: Profile, executor: str = "reference", q: str = "median", scale: float = 1.0):
        if executor not in ("reference", "epoch"):
            raise ValueError(f"executor={executor!r}: allowed reference, epoch")
        if q not in QUANTILES:
            raise ValueError(f"q={q!r}: allowed {', '.join(QUANTILES)}")
        if not scale > 0:
            raise ValueError(f"scale={scale}: must be positive")
        self.profile, self.executor, self.q = profile, executor, q
        self.scale = float(scale)        # the machine's drift since profiling (profiler.drift), 1 = none
        m = profile.model
        try:
            self.L = int(m["num_hidden_layers"])
            self.n_moe = int(m["n_moe_layers"])
            self.E = int(m["num_experts"])
            self.K = int(m["num_experts_per_tok"])
        except KeyError as e:
            raise ValueError(f"profile: meta.model lacks {e}") from None
        self.n_dense = self.L - self.n_moe
        if executor == "epoch":
            profile["epoch_moe"]      # raises a clear error when the profile has no Epoch tables

    def with_q(self, q: str) -> "ProfiledCost":
        return ProfiledCost(self.profile, self.executor, q, self.scale)

    def parts(self, s: CallShape) -> dict:
        """Seconds per operator group for one call."""
        p, q = self.profile, self.q
        N = s.padded_rows
        out = {"attention": self.L * p["attention"](s.requests, s.rows, s.context, q=q)}
        if self.n_dense:
            out["dense_mlp"] = self.n_dense * p["dense_mlp"](N, q=q)
        epoch = self.executor == "epoch" and s.kind == "denoise"
        if self.n_moe:
            if epoch:
                out["moe"] = self.n_moe * p["epoch_moe"](s.valid_rows, s.fresh_frac, q=q)
            else:
                out["router"] = self.n_moe * p["router"](N, q=q)
                out["moe"] = self.n_moe * p["moe"](N, max(float(self.K), touched_experts(N, self.E, self.K)), q=q)
        if s.kind == "denoise":
            out["lm_head"] = sum(p["lm_head"](x, q=q) for x in s.live if x > 0)
            name = "epoch_call_denoise" if epoch else "call_denoise"
            out["call"] = p[name](s.requests, s.segments, q=q)
        else:
            out["call"] = p["call_append"](s.requests, q=q)
        return out

    def call(self, s: CallShape) -> float:
        return self.scale * float(sum(self.parts(s).values()))

    def driver(self, requests: int) -> float:
        """The schedule's host work of one iteration with `requests` running (outside the executor calls)."""
        p = self.profile
        return self.scale * p["driver"](requests, q=self.q) if p.has("driver") else 0.0

    def admit(self, requests: int) -> float:
        """Extra host work of the iteration that admits `requests` new requests (serving)."""
        p = self.profile
        return self.scale * p["admit"](requests, q=self.q) if requests and p.has("admit") else 0.0

    def describe(self) -> str:
        m = self.profile.meta
        return (f"profile of {m.get('model', {}).get('name', '?')} on {m.get('machine', '?')} "
                f"({self.executor}, {self.q})")


class RooflineCost:
    """`cost.pass_cost` behind the `ProfiledCost` interface, for hardware that cannot be measured here."""

    def __init__(self, cfg, hw, par=None, cal=None, path: str = "dense", block: int | None = None):
        from dblock.simulator import cost
        self.cost, self.cfg, self.hw = cost, cfg, hw
        self.par = par or cost.Parallel()
        self.cal = cal or cost.Calibration()
        self.path = path
        self.block = block or cfg.block_size
        self.executor = "epoch" if path == "epoch" else "reference"
        self.q = "median"

    def with_q(self, q: str) -> "RooflineCost":
        return self

    def call(self, s: CallShape) -> float:
        C = self.block
        per_req = s.rows
        layout = "native" if per_req <= C else "oba"
        live_frac = min(1.0, sum(s.live) / max(1, s.valid_rows)) if s.live else 1.0
        shape = self.cost.PassShape(batch=s.requests, layout=layout, block=C,
                                    cache_len=max(0.0, s.context - per_req),
                                    path=self.path if s.kind == "denoise" else "dense", live_frac=live_frac,
                                    fresh_frac=min(1.0, max(0.0, s.fresh_frac)))
        if s.kind == "append":
            shape = self.cost.PassShape(batch=0, block=C, cache_len=max(0.0, s.context - per_req),
                                        extra_rows=s.padded_rows)
        return self.cost.pass_cost(self.cfg, shape, self.hw, self.par, self.cal).total

    def driver(self, requests: int) -> float:
        return 0.0

    def describe(self) -> str:
        return f"roofline on {self.hw.name} ({self.path})"


def model_meta(cfg) -> dict:
    """The model facts a profile needs to price a pass (written into `Profile.meta['model']`)."""
    moe_layers = list(getattr(cfg, "moe_layers", []) or [])
    return dict(family=getattr(cfg, "family", "?"), num_hidden_layers=int(cfg.num_hidden_layers),
                n_moe_layers=len(moe_layers), num_experts=int(getattr(cfg, "num_experts", 0) or 0),
                num_experts_per_tok=int(getattr(cfg, "num_experts_per_tok", 0) or 0),
                hidden_size=int(cfg.hidden_size), vocab_size=int(cfg.vocab_size),
                block_size=int(getattr(cfg, "block_size", 0) or 0))


def geometric_grid(lo: int, hi: int, factor: float = 2.0) -> list:
    """lo, lo·factor, ... up to and including hi (integers, ascending, no repeats)."""
    out, x = [], float(lo)
    while x < hi:
        v = int(round(x))
        if not out or v > out[-1]:
            out.append(v)
        x *= factor
    if not out or hi > out[-1]:
        out.append(int(hi))
    return out


def relative_spread(values: Sequence[float]) -> float:
    """(75th − 25th percentile) / median of repeated measurements; NaN for fewer than two."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if v.size < 2 or np.median(v) == 0:
        return float("nan")
    return float((np.percentile(v, 75) - np.percentile(v, 25)) / np.median(v))
