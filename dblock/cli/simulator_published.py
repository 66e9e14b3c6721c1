"""`dblock simulate calibrate --published [FILE]` and `dblock simulate validate --published [FILE]`: the GPU cost
model fitted on published measurements (dblock/simulator/gpufit.py) and checked against every published point."""
from __future__ import annotations

import math

from dblock.out_paths import check_out_file
from dblock.cli.simulator_common import _emit


def calibrate_published(args) -> int:
    """Fit on the file's calibration points; print every fitted value with the points that determine it; write the
    fit to --out when given (the project's stored fit is `dblock/simulator/data/gpu_fit.json`)."""
    from dblock.simulator import gpufit, published
    if args.out:
        check_out_file(args.out, "--out")
    pf = published.load(args.published)
    res = gpufit.fit(pf.points)
    if args.out:
        gpufit.save_fit(res, args.out, source=args.published)
    lines = gpufit.fit_lines(res)
    lines.append("calibration residuals (predicted / published − 1): " + ", ".join(
        f"{k} {100 * (math.exp(v) - 1):+.1f}%" for k, v in res.residuals.items()))
    if args.out:
        lines.append(f"written to {args.out}")
    _emit(args, dict(fit=res.as_dict(), written=args.out), "\n".join(lines))
    return 0


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return f"{_fmt(v[0])}..{_fmt(v[1])}"
    if not math.isfinite(v):
        return "inf"
    return f"{v:.4g}"


def validate_published(args) -> int:
    """Every point of the file predicted beside its published value, with the error and whether it was fitted."""
    from dblock.simulator import gpufit, published
    pf = published.load(args.published)
    fit_path = args.fit or gpufit.FIT_PATH
    try:
        params, rec = gpufit.load_fit(fit_path)
    except (OSError, ValueError, KeyError) as e:
        from dblock.errors import ConfigError
        raise ConfigError(f"--fit {fit_path}: not a fit written by `simulate calibrate --published --out` ({e})") \
            from None
    rs = gpufit.rows(pf, params, rec.get("calibration_points") or [])
    summ = gpufit.summary(rs)
    hdr = f"{'id':<10} {'metric':<22} {'model':<15} {'hardware':<8} {'published':>13} {'predicted':>10} {'error':>8}  role"
    lines = [f"{args.published}: {len(rs)} points predicted with the fit {fit_path} (fitted on "
             f"{len(rec.get('calibration') or [])} calibration points)", hdr, "-" * len(hdr)]
    for r in rs:
        err = "-" if r["error"] is None else f"{100 * r['error']:+.1f}%"
        lines.append(f"{r['id']:<10} {r['metric']:<22} {r['model']:<15} {r['hardware']:<8} {_fmt(r['published']):>13} "
                     f"{_fmt(r['predicted']):>10} {err:>8}  {r['role']}"
                     + (f"  [not predicted: {r['not_predicted']}]" if r["predicted"] is None else ""))
    for k, label in (("fit", "fit rows"), ("held_out", "held-out rows")):
        s = summ[k]
        if s["n"]:
            lines.append(f"{label}: median |error| {100 * s['median_abs_error']:.1f}% over {s['n']}, largest "
                         f"{100 * s['max_abs_error']:.1f}%; beyond 2x: {', '.join(s['beyond_2x']) or 'none'}")
    if summ["not_predicted"]:
        lines.append(f"not predicted: {', '.join(summ['not_predicted'])} (reasons in their rows)")
    lines.append("error = predicted / published − 1 (for a range: 0 inside it, else against the nearer end); the "
                 "assumptions each prediction made are in --json (`assumptions`)")
    _emit(args, dict(file=args.published, fit=fit_path, rows=rs, summary=summ), "\n".join(lines))
    return 0
