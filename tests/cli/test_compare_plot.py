"""`dblock.profiling.compare.plot`: the compare-schedules rows as a break-even map beside TPF/TPS bars relative to Native."""
import pytest

pytest.importorskip("matplotlib")

from dblock.profiling.compare import derive, plot  # noqa: E402
from dblock.errors import ConfigError  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows():
    """Rows shaped as `compare_schedules` returns them after `derive` (only the fields the plot reads)."""
    return [
        dict(schedule="native", TPF=2.0, TPS=100.0, r=1.0, alpha=0.0, alpha_naive=0.0, TPF_ratio=1.0,
             TPS_ratio=1.0),
        dict(schedule="native2c", TPF=2.4, TPS=90.0, r=1.3, alpha=None, alpha_naive=None, TPF_ratio=1.2,
             TPS_ratio=0.9, TPF_ratio_ci=[1.1, 1.3]),
        dict(schedule="oba", TPF=2.6, TPS=120.0, r=1.1, alpha=0.35, alpha_naive=0.2, TPF_ratio=1.3,
             TPS_ratio=1.2, alpha_ci=[0.2, 0.5], TPF_ratio_ci=[1.2, 1.4]),
        # the fit failed: the naive estimate stands in, as in the verdict
        dict(schedule="flowblock", TPF=2.1, TPS=80.0, r=1.4, alpha=None, alpha_naive=0.1, TPF_ratio=1.05,
             TPS_ratio=0.8),
        dict(schedule="no_signal", TPF=1.9, TPS=70.0, r=1.2, alpha=-0.1, alpha_naive=-0.05, TPF_ratio=0.95,
             TPS_ratio=0.7),
    ]


def _points(ax):
    """{label: (r, alpha)} of the labelled markers on the break-even map."""
    return {line.get_gid(): tuple(line.get_xydata()[0]) for line in ax.get_lines() if line.get_gid()}


def test_plot_writes_png_and_points_match_rows(tmp_path):
    out = tmp_path / "cmp.png"
    fig = plot(_rows(), str(out))
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    ax_map, ax_bars = fig.axes
    assert _points(ax_map) == {"native": (1.0, 0.0), "oba": (1.1, 0.35), "flowblock": (1.4, 0.1),
                               "no_signal": (1.2, -0.1)}
    assert sorted(t.get_text() for t in ax_map.texts) == ["flowblock", "native", "no_signal", "oba"]
    # the break-even line is α = r − 1 and the shaded region lies above it
    line = next(ln for ln in ax_map.get_lines() if ln.get_label().startswith("break-even"))
    x, y = line.get_data()
    assert y == pytest.approx(x - 1)
    shade = ax_map.collections[0].get_paths()[0].vertices
    assert shade[:, 1].max() >= 0.5     # up to the top of the plot, above the highest point and its interval
    # colours: pays (α > r − 1) green, does not pay red, Native the grey reference
    colour = {ln.get_gid(): ln.get_color() for ln in ax_map.get_lines() if ln.get_gid()}
    assert colour == {"native": "tab:gray", "oba": "tab:green", "flowblock": "tab:red", "no_signal": "tab:red"}

    # bars: every schedule but Native, TPF then TPS over Native's
    names = [t.get_text() for t in ax_bars.get_xticklabels()]
    assert names == ["native2c", "oba", "flowblock", "no_signal"]
    tpf, tps = ax_bars.containers[:2]
    assert [b.get_height() for b in tpf] == pytest.approx([1.2, 1.3, 1.05, 0.95])
    assert [b.get_height() for b in tps] == pytest.approx([0.9, 1.2, 0.8, 0.7])
    assert any(ln.get_ydata()[0] == 1.0 and ln.get_label() == "Native" for ln in ax_bars.get_lines())


def test_plot_merges_coincident_points_and_needs_native(tmp_path):
    rows = _rows() + [dict(schedule="keep_tokens", TPF=2.6, TPS=120.0, r=1.1, alpha=0.35, TPF_ratio=1.3,
                           TPS_ratio=1.2)]
    ax_map = plot(rows).axes[0]           # no path: nothing written, the figure returned
    assert "oba / keep_tokens" in [t.get_text() for t in ax_map.texts]
    assert not list(tmp_path.iterdir())
    with pytest.raises(ConfigError, match="native"):
        plot([r for r in _rows() if r["schedule"] != "native"])
    # rows derived without a Native row have no r: same error
    with pytest.raises(ConfigError, match="native"):
        plot(derive([{"schedule": "oba", "T_den_ms": 1.0, "F": 10, "K": 2, "R": 1, "TPF": 1.0, "TPS": 1.0}]))


def test_plot_from_measured_rows(tmp_path):
    """Rows as compare_schedules really computes them (tiny model), plotted."""
    from dblock.profiling.compare import compare_schedules
    from dblock.decoding.generate import reference_forward
    from dblock.decoding.params import DecodeConfig
    from dblock.tiny import make_tiny_model
    fwd = reference_forward(make_tiny_model("llada2_moe", seed=1))
    rows = compare_schedules(fwd, [[5, 6, 7], [9, 10, 11, 12]], DecodeConfig(max_new_tokens=16),
                             ["native", "oba", "native2c"], seeds=[0])
    fig = plot(rows, str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").read_bytes().startswith(PNG_MAGIC)
    points = _points(fig.axes[0])
    assert set(points) <= {"native", "oba", "native / oba"} and points
    oba = rows[1]
    a = oba["alpha"] if oba["alpha"] is not None else oba["alpha_naive"]
    assert (oba["r"], a) in points.values()
