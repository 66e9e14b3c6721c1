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
