"""What the `dblock simulate` subcommands share: comma-separated and distribution flags parsed with one clear error
naming the flag (`_floats`, `_positive_floats`, `_ints`, `_dist`), and the output as text or JSON (`_emit`). Whether
to draw progress bars is `dblock.cli_args.show_progress`."""
from __future__ import annotations

import json
import math


def _floats(text: str, flag: str = "") -> list[float]:
    """Comma-separated finite numbers (`flag` names the option in errors)."""
    where = f"{flag} " if flag else ""
    try:
        vals = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{where}{str(text)[:60]!r}: expected a comma-separated list of numbers") from None
    bad = next((v for v in vals if not math.isfinite(v)), None)
    if bad is not None:
        raise ValueError(f"{where}{str(text)[:60]!r}: {bad} is not a finite number")
    return vals


def _positive_floats(text: str, flag: str) -> list[float]:
    vals = _floats(text, flag)
    if not vals or min(vals) <= 0:
        raise ValueError(f"{flag} {str(text)[:60]!r}: give one or more positive numbers")
    return vals


def _ints(text: str, flag: str = "", hi: int = 1 << 20) -> list[int]:
    """Comma-separated integers in [1, hi]."""
    vals = _floats(text, flag)
    if not vals or any(v != int(v) or not 1 <= v <= hi for v in vals):
        raise ValueError(f"{flag + ' ' if flag else ''}{str(text)[:60]!r}: give one or more integers in [1, {hi}]")
    return [int(v) for v in vals]


def _dist(text: str, flag: str, max_mean: float) -> str:
    """A distribution flag (`kind:params`, dblock/simulator/dists.py) with finite parameters and a mean of at most
    `max_mean`; returned as given."""
    from dblock.simulator.dists import Dist
    try:
        d = Dist.parse(text)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    if not all(math.isfinite(v) for v in d.params):
        raise ValueError(f"{flag} {text!r}: parameters must be finite numbers")
    mean = d.params[0] if d.kind != "uniform" else sum(d.params) / 2
    if d.kind == "empirical":
        mean = max(d.params) if d.params else 0
    if mean > max_mean:
        raise ValueError(f"{flag} {text!r}: mean {mean:g} is beyond {max_mean:g}")
    return text


def _emit(args, data: dict, text: str) -> None:
    if args.json:
        print(json.dumps(data, indent=2, default=_jsonable))
    else:
        print(text)


def _jsonable(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "__dict__"):
        return vars(o)
    return str(o)
