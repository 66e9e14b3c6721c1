"""The staleness curve (the Epoch paper's argument for M_C = 5): how similar is a cached routed-expert output to the
fresh one, as a function of its age, for decoded vs live positions?

Two measurements, both on the optimized executor's own (teacher-forced) trajectory:

  lagged   for every row of an in-flight block, the cosine between its *fresh* routed output (the shadow
           reference's, dense and exact given the pass's inputs) now and k passes ago, k = 1..K. "decoded" rows held
           the same token at both passes (the rows LSP would serve from its cache at age k); "live" rows were still
           MASK now (always recomputed by LSP: the contrast the paper draws). This extends past M_C, showing where
           the curve would go with a longer refresh period.
  served   for every cache read the executor actually made, the cosine between the served entry and the fresh
           reference output at that pass, by the entry's age (only ages 1..M_C-1 exist in a correct executor).
           It includes the upstream drift of the optimized hidden states, so it is the end-to-end staleness.

The paper's claim: with refresh period M = 5 the mean cosine stays above 0.95. Our reading: the mean over all cache
reads made under M_C = 5 (`served_mean`), and the lagged decoded curve at k = M_C - 1 (the oldest entry ever read)
and at k = M_C.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

CLAIM = 0.95


def stats(values) -> dict:
    if not values:
        return {"n": 0, "mean": None, "std": None, "p05": None, "p25": None, "median": None, "p75": None,
                "min": None}
    t = torch.tensor(values, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.05, 0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
    return {"n": int(t.numel()), "mean": float(t.mean()), "std": float(t.std()) if t.numel() > 1 else 0.0,
            "p05": q[0], "p25": q[1], "median": q[2], "p75": q[3], "min": float(t.min())}


def staleness_table(shadow, max_age: int, refresh: Optional[int]) -> dict:
    """Per age k: lagged cosine stats for decoded and live rows, served-entry stats; plus the summary numbers."""
    rows = []
    for k in range(1, max_age + 1):
        rows.append({"age": k, "decoded": stats(shadow.lagged_cos.get(("decoded", k), [])),
                     "live": stats(shadow.lagged_cos.get(("live", k), [])),
                     "served": stats(shadow.served_cos.get(k, []))})
    per_layer = {}
    for li in shadow.moe_layers:
        per_layer[li] = {kind: [stats(shadow.lagged_layer.get((kind, k, li), []))["mean"]
                                for k in range(1, max_age + 1)] for kind in ("decoded", "live")}
    served_all = [v for vals in shadow.served_cos.values() for v in vals]
    by_k = {r["age"]: r for r in rows}
    out = {"max_age": max_age, "M_C": refresh, "rows": rows, "per_layer": per_layer,
           "served_mean": stats(served_all)["mean"], "served_reads": len(served_all), "claim": CLAIM}
    if refresh:
        for name, k in (("at_max_read_age", refresh - 1), ("at_M_C", refresh)):
            r = by_k.get(k)
            out[name] = {"age": k, "decoded": r["decoded"]["mean"] if r else None,
                         "live": r["live"]["mean"] if r else None} if k >= 1 else None
    return out


def format_table(t: dict, title: str = "") -> str:
    def f(x):
        return "   -  " if x is None else f"{x:6.4f}"
    lines = [title] if title else []
    lines.append("age | decoded mean  std    p05    (n)     | live mean  std    (n)     | served mean  min    (n)")
    for r in t["rows"]:
        d, lv, s = r["decoded"], r["live"], r["served"]
        lines.append(f"{r['age']:3d} | {f(d['mean'])} {f(d['std'])} {f(d['p05'])} ({d['n']:6d}) | "
                     f"{f(lv['mean'])} {f(lv['std'])} ({lv['n']:6d}) | {f(s['mean'])} {f(s['min'])} ({s['n']:6d})")
    if t.get("served_reads"):
        lines.append(f"mean cosine over all {t['served_reads']} cache reads (M_C = {t['M_C']}): "
                     f"{t['served_mean']:.4f} (paper: > {t['claim']})")
    for name in ("at_max_read_age", "at_M_C"):
        v = t.get(name)
        if v and v["decoded"] is not None:
            live = "-" if v["live"] is None else f"{v['live']:.4f}"
            lines.append(f"lagged cosine at age {v['age']}: decoded {v['decoded']:.4f}, live {live}")
    return "\n".join(lines)


def plot(tables: dict, path: str, refresh: Optional[int] = None, title: str = "") -> str:
    """PNG of the curves: mean and interquartile band of the lagged cosine for decoded and live rows, served-entry
    means, the M_C line and the paper's 0.95. `tables`: label -> staleness_table()."""
    import matplotlib
    import sys
    if "matplotlib.pyplot" not in sys.modules:  # headless default; keep a notebook's backend
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ["-", "--", ":"]
    for i, (label, t) in enumerate(tables.items()):
        ls = styles[i % len(styles)]
        for kind, color in (("decoded", "tab:blue"), ("live", "tab:orange")):
            pts = [(r["age"], r[kind]["mean"], r[kind]["p25"], r[kind]["p75"]) for r in t["rows"]
                   if r[kind]["mean"] is not None]
            if not pts:
                continue
            k, m, lo, hi = zip(*pts)
            ax.plot(k, m, ls, color=color, marker="o", ms=3, label=f"{kind} rows, mean (lagged, {label})")
            if i == 0:
                ax.fill_between(k, lo, hi, color=color, alpha=0.15, lw=0, label=f"{kind} rows, 25-75% ({label})")
        pts = [(r["age"], r["served"]["mean"]) for r in t["rows"] if r["served"]["mean"] is not None]
        if pts:
            k, m = zip(*pts)
            ax.plot(k, m, "s", color="tab:green", ms=5, mfc="none" if i else "tab:green",
                    label=f"served cache entries ({label})")
    ax.axhline(CLAIM, color="grey", lw=0.8, ls="--")
    ax.text(0.98, CLAIM, f" paper: > {CLAIM}", va="bottom", ha="right", transform=ax.get_yaxis_transform(),
            color="grey", fontsize=8)
    if refresh:
        ax.axvline(refresh - 0.5, color="red", lw=0.8, ls=":")
        ax.text(refresh - 0.45, 0.02, f"M_C = {refresh}: reads stop here", color="red", fontsize=8,
                transform=ax.get_xaxis_transform())
    ax.set_xlabel("age k (passes since the routed output was computed)")
    ax.set_ylabel("cosine(routed output now, k passes ago)")
    ax.set_title(title or "Staleness of routed-expert outputs")
    lo = min([min(r[kind]["mean"], r[kind]["p25"]) for t in tables.values() for r in t["rows"]
              for kind in ("decoded", "live") if r[kind]["mean"] is not None] + [0.9])
    ax.set_ylim(max(-1.0, math.floor(lo * 10) / 10), 1.005)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
