"""Plots of the simulator's outputs (matplotlib, Agg backend: files only, no display)."""
from __future__ import annotations

import numpy as np


def _plt():
    import matplotlib
    import sys
    if "matplotlib.pyplot" not in sys.modules:  # headless default; keep a notebook's backend
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def alpha_recurrence(nbar: float, alpha: float, path: str, k_max: int = 12, simulated: np.ndarray | None = None):
    """n_k of Eq. (3) converging to n* = n̄/(1+α), optionally with simulated means per block index."""
    from dblock.simulator import oba
    plt = _plt()
    k = np.arange(1, k_max + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(k, oba.transient(nbar, alpha, k), "o-", label="closed form n_k = n*(1-(-α)^k)")
    ax.axhline(oba.fixed_point(nbar, alpha), ls="--", c="gray", label=f"n* = {oba.fixed_point(nbar, alpha):.2f}")
    if simulated is not None:
        m = min(k_max, len(simulated))
        ax.plot(k[:m], simulated[:m], "s", mfc="none", label="SimPy mean")
    ax.set_xlabel("block index k")
    ax.set_ylabel("passes as current block")
    ax.set_title(f"OBA recurrence, n̄ = {nbar:g}, α = {alpha:g}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def break_even_map(points: list[dict], path: str):
    """α vs r with the break-even line α = r − 1; each schedule a labelled point."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    rs = [p["r"] for p in points]
    r = np.linspace(min(0.95, min(rs) - 0.05), max(rs) + 0.1, 50)
    ax.plot(r, r - 1, "k--", label="break-even α = r − 1")
    ax.fill_between(r, r - 1, 1.0, color="tab:green", alpha=0.08, label="pays")
    merged: dict = {}   # schedules at the same (r, α) share one point and one label
    for p in points:
        merged.setdefault((p["r"], p["alpha"]), []).append(p["name"])
    for (r_, a_), names in merged.items():
        ax.plot(r_, a_, "o", c="tab:green" if a_ > r_ - 1 else "tab:red")
        ax.annotate(" / ".join(names), (r_, a_), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("r (pass cost over Native)")
    ax.set_ylabel("α (passes saved per warm-up step)")
    ax.set_ylim(-0.05, 1.0)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def speedup_vs_batch(rows: list[dict], path: str):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    b = [r["batch"] for r in rows]
    ax.plot(b, [r["speedup"] for r in rows], "o-", label="predicted Epoch / dense")
    for r in rows:
        if r.get("paper"):
            lo, hi = r["paper"]
            ax.plot([r["batch"]] * 2, [lo, hi], "r-", lw=6, alpha=0.4)
        if r.get("dense_oom"):
            ax.annotate("dense OOM", (r["batch"], r["speedup"]), xytext=(0, 8), textcoords="offset points")
    ax.plot([], [], "r-", lw=6, alpha=0.4, label="paper range")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def itl_vs_rate(curves: dict, path: str, slo: float | None = None):
    """P95 ITL against Poisson rate, one line per path ({"dense": [...], "epoch": [...]})."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in curves.items():
        ax.plot([p["rate"] for p in pts], [1e3 * p["p95_itl"] for p in pts], "o-", label=name)
    if slo:
        ax.axhline(1e3 * slo, ls="--", c="gray", label="SLO")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("P95 equivalent ITL (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- compare-schedules (measured rows, dblock/profiling/compare.py) -------------------------------------------

def _figure(**kw):
    """A figure outside pyplot: no backend is chosen or changed (a notebook keeps its own; a PNG is written by
    Agg), nothing stays registered after the call, and a notebook can still display the returned figure."""
    from matplotlib.figure import Figure
    return Figure(**kw)


def draw_break_even(ax, points: list[dict]):
    """α against r: the break-even line α = r − 1, the region above it shaded (the schedule pays in throughput),
    every point labelled with its name(s); points at the same (r, α) share one marker and one label. A point:
    name, r, alpha, optional alpha_ci (lo, hi) and reference (True: drawn hollow and grey, e.g. Native)."""
    rs = [p["r"] for p in points] + [1.0]
    alphas = [p["alpha"] for p in points] + [0.0]
    for p in points:
        if p.get("alpha_ci"):
            alphas += list(p["alpha_ci"])
    x0, x1 = min(rs), max(rs)
    pad = max(0.05, 0.15 * (x1 - x0))
    x = np.linspace(x0 - pad, x1 + pad, 100)
    y0 = min(min(alphas), x0 - pad - 1) - 0.05
    y1 = max(max(alphas), x1 + pad - 1) + 0.1
    ax.plot(x, x - 1, "k--", lw=1, label="break-even α = r − 1")
    ax.fill_between(x, x - 1, y1, color="tab:green", alpha=0.08, label="pays: α > r − 1")
    merged: dict = {}
    for p in points:
        merged.setdefault((p["r"], p["alpha"]), []).append(p)
    for (r_, a_), ps in merged.items():
        names = " / ".join(p["name"] for p in ps)
        ref = all(p.get("reference") for p in ps)
        color = "tab:gray" if ref else ("tab:green" if a_ > r_ - 1 else "tab:red")
        ci = next((p["alpha_ci"] for p in ps if p.get("alpha_ci")), None)
        if ci is not None:
            ax.errorbar([r_], [a_], yerr=[[a_ - ci[0]], [ci[1] - a_]], fmt="none", ecolor=color, lw=1, capsize=3)
        ax.plot([r_], [a_], "o", color=color, mfc="white" if ref else color, gid=names)
        ax.annotate(names, (r_, a_), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlim(x[0], x[-1])
    ax.set_ylim(y0, y1)
    ax.set_xlabel("r (pass cost over Native)")
    ax.set_ylabel("α (passes saved per warm-up step)")
    ax.set_title("break-even map")
    ax.legend(loc="upper left", fontsize=8)


def draw_ratio_bars(ax, bars: list[dict]):
    """TPF and TPS of each schedule over Native's, side by side, with a line at 1 (Native). A bar: name, tpf, tps,
    optional tpf_ci (lo, hi), drawn as an error bar. Each bar carries its value as a label."""
    ax.set_title("throughput relative to Native")
    if not bars:
        ax.text(0.5, 0.5, "no schedule besides Native", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    idx = np.arange(len(bars))
    w = 0.38
    tpf = np.array([b["tpf"] if b["tpf"] is not None else np.nan for b in bars], dtype=float)
    tps = np.array([b["tps"] if b["tps"] is not None else np.nan for b in bars], dtype=float)
    c1 = ax.bar(idx - w / 2, tpf, w, color="tab:blue", label="TPF / Native")
    c2 = ax.bar(idx + w / 2, tps, w, color="tab:orange", label="TPS / Native")
    tops = [tpf.copy(), tps]
    for i, b in enumerate(bars):
        if b.get("tpf_ci") and np.isfinite(tpf[i]):
            lo, hi = b["tpf_ci"]
            ax.errorbar([idx[i] - w / 2], [tpf[i]], yerr=[[tpf[i] - lo], [hi - tpf[i]]], fmt="none", ecolor="k",
                        lw=1, capsize=3)
            tops[0][i] = max(tpf[i], hi)
    for c, vals, top in ((c1, tpf, tops[0]), (c2, tps, tops[1])):
        for rect, v, t in zip(c, vals, top):
            if np.isfinite(v):
                ax.annotate(f"{v:.2f}", (rect.get_x() + rect.get_width() / 2, t), textcoords="offset points",
                            xytext=(0, 2), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="k", lw=1, ls="--", label="Native")
    finite = [v for v in np.concatenate(tops) if np.isfinite(v)] + [1.0]
    ax.set_ylim(0, 1.22 * max(finite))
    ax.set_xticks(idx)
    ax.set_xticklabels([b["name"] for b in bars], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ratio to Native")
    ax.legend(loc="upper center", ncol=3, fontsize=8)


def plan_frontier(points: list[dict], plans: list[dict], path: str, title: str = ""):
    """Cost per million output tokens vs predicted P95 ITL (`simulate plan --plot`): every shape that fits at 1x..4x
    the replicas it needs (analytic), the Pareto frontier (nothing both cheaper and faster), the plans (simulated)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in sorted({c["hardware"] for c in points}):
        cs = [c for c in points if c["hardware"] == k]
        ax.scatter([1e3 * c["p95_itl_s"] for c in cs], [c["cost_per_mtok"] for c in cs], s=8, alpha=0.4, label=k)
    pts = sorted((1e3 * c["p95_itl_s"], c["cost_per_mtok"]) for c in points)
    front, best = [], float("inf")
    for x, y in pts:
        if y < best:
            front.append((x, y))
            best = y
    if front:
        ax.step([x for x, _ in front], [y for _, y in front], where="post", c="k", lw=1.2, label="Pareto frontier")
    if plans:
        ax.scatter([1e3 * p["p95_itl_s"] for p in plans], [p["cost_per_mtok"] for p in plans], marker="*", s=120,
                   c="red", zorder=5, label="plans (P95 simulated)")
    ax.set_xlabel("P95 ITL (ms; analytic for the cloud, simulated for the plans)")
    ax.set_ylabel("US$ per million output tokens")
    ax.set_yscale("log")
    ax.set_title(title or "capacity plan: cost vs latency")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
