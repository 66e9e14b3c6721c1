"""`dblock compare-schedules`: every schedule runs on the same prompts; the derived columns follow their formulas."""
import json

import pytest

from dblock.cli import main
from dblock.profiling.compare import compare_schedules, derive
from dblock.decoding.generate import reference_forward
from dblock.decoding.params import DecodeConfig
from dblock.simulator.oba import fit_alpha
from dblock.tiny import make_tiny_model


def test_rows_and_derived_columns():
    fwd = reference_forward(make_tiny_model("llada2_moe", seed=1))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    calls = []

    def grader(ids, out):
        calls.append((tuple(ids), tuple(out)))
        return len(out) % 2 == 0
    rows = compare_schedules(fwd, prompts, DecodeConfig(max_new_tokens=24), ["native", "oba", "native2c"],
                             seeds=[0, 100], grader=grader)
    assert [r["schedule"] for r in rows] == ["native", "oba", "native2c"]
    native, oba, wide = rows
    assert native["r"] == 1.0 and native["R"] == 4 and len(calls) == 12
    nbar = native["F"] / native["K"]
    assert oba["alpha_naive"] == pytest.approx(nbar / (oba["F"] / oba["K"]) - 1)
    assert oba["alpha"] == pytest.approx(fit_alpha(oba["F"], oba["K"], oba["R"], nbar))
    assert oba["verdict"] == ("pays" if oba["alpha"] > oba["r"] - 1 else "does not pay")
    assert wide["alpha"] is None and 0.0 <= native["accuracy"] <= 1.0
    # the paired pass counts once in F, and OBA never takes more passes than Native on these prompts
    assert oba["F"] <= native["F"]


def test_code_quality_columns_first_block_and_whole_answer():
    """A code-task grader's dict: token accuracy of the first block and of the whole answer, each with its CI, and
    the paired Δ against Native; the printed table carries both."""
    from dblock.profiling.compare import format_table
    fwd = reference_forward(make_tiny_model("llada2_moe", seed=1))

    def grader(ids, out):
        out = [int(t) for t in out]
        return {"correct": False, "token_accuracy": (sum(out[:8]) % 5) / 4,
                "answer_token_accuracy": (sum(out) % 3) / 2}
    rows = compare_schedules(fwd, [[5, 6, 7], [9, 10, 11, 12, 13]], DecodeConfig(max_new_tokens=24),
                             ["native", "oba"], seeds=[0, 100], grader=grader)
    native, oba = rows
    aa = native["per_request_quality"]["answer_token_accuracy"]
    assert len(aa) == 4 and native["answer_token_accuracy"] == pytest.approx(sum(aa) / 4)
    lo, hi = native["answer_token_accuracy_ci"]
    assert lo <= native["answer_token_accuracy"] <= hi
    d_lo, d_hi = oba["answer_token_accuracy_delta_ci"]
    diff = oba["answer_token_accuracy"] - native["answer_token_accuracy"]
    assert d_lo - 1e-12 <= diff <= d_hi + 1e-12 and "answer_token_accuracy_delta_ci" not in native
    assert "ans-tok" in format_table(rows) and "Δans 95% CI" in format_table(rows)


def test_derive_without_native_leaves_ratios_empty():
    rows = derive([{"schedule": "oba", "T_den_ms": 1.0, "F": 10, "K": 2, "R": 1, "TPF": 1.0, "TPS": 1.0}])
    assert rows[0]["r"] is None and rows[0]["verdict"] is None


def test_cli_json_and_llada_moe_skips_multiblock(tmp_path, tiny_dirs, capsys):
    f = tmp_path / "p.txt"
    f.write_text("[5, 6, 7]\n\n[8, 9]\n")
    rc = main(["compare-schedules", "--model", tiny_dirs["llada_moe"], "--prompts", str(f), "--max-new-tokens",
               "16", "--json", "--schedules", "native,oba,native2c"])
    rows = json.loads(capsys.readouterr().out)
    assert rc == 0 and [r["schedule"] for r in rows] == ["native", "native2c"]
    f.write_text("hello\n")
    rc = main(["compare-schedules", "--model", tiny_dirs["llada2_moe"], "--prompts", str(f)])
    assert rc == 2 and "tokenizer.json" in capsys.readouterr().err


def _row(name, Y, Q, F, K):
    return {"schedule": name, "T_den_ms": 1.0, "TPF": sum(Y) / sum(Q), "TPS": 1.0, "F": sum(F), "K": sum(K),
            "R": len(Y), "per_request": {"Y": Y, "Q": Q, "F": F, "K": K}}


def test_paired_bootstrap_intervals():
    from dblock.profiling.compare import paired_bootstrap
    # requests of very different lengths; the schedule saves exactly one pass in every request of 3 blocks
    Y = [16, 48, 16, 48, 48, 16] * 5
    Kb = [1, 3, 1, 3, 3, 1] * 5
    Fb = [2, 30, 1, 24, 27, 3] * 5
    Fo = [f - (k == 3) for f, k in zip(Fb, Kb)]
    base = _row("native", Y, [f + k for f, k in zip(Fb, Kb)], Fb, Kb)
    oba = _row("oba", Y, [f + k for f, k in zip(Fo, Kb)], Fo, Kb)
    ci = paired_bootstrap(oba, base, n_boot=400)
    lo, hi = ci["TPF_ratio_ci"]
    assert 1.0 < lo <= oba["TPF"] / base["TPF"] <= hi      # every resample shows the saving: the interval excludes 1
    alo, ahi = ci["alpha_ci"]
    assert 0.0 < alo <= ahi < 1.0
    # identical rows: a degenerate interval at exactly 1
    assert paired_bootstrap(base, base, n_boot=50)["TPF_ratio_ci"] == [1.0, 1.0]
    # different request sets cannot be paired: no interval rather than a wrong one
    assert paired_bootstrap(_row("x", Y[:5], Y[:5], Fb[:5], Kb[:5]), base) == {}
    # derive attaches them to every non-native row and the table prints them
    from dblock.profiling.compare import format_table
    rows = derive([base, oba])
    assert "TPF_ratio_ci" in rows[1] and "TPF_ratio_ci" not in rows[0]
    dlo, dhi = rows[1]["TPF_ratio_ci"]
    assert f"{dlo:.2f}..{dhi:.2f}" in format_table(rows)


def test_short_responses_with_alpha_near_one_fit_by_eq5():
    """The warm-up block nearly finishes the next block (α ≈ 0.9) and responses have two blocks: Eq. 6 has no root,
    so the row's α and its interval come from Eq. 5 on the per-response blocks, and the table says so."""
    from dblock.profiling.compare import format_table
    from dblock.simulator import oba as oba_model
    nbar, alpha = 40, 0.9
    Kb = [2, 2, 2, 3] * 6
    Fb = [nbar * k for k in Kb]
    # each request's passes under the recurrence n_1 = n̄, n_k = n̄ − α·n_{k−1} (rounded to whole passes)
    Fo = [round(sum(oba_model.transient(nbar, alpha, j) for j in range(1, k + 1))) for k in Kb]
    Y = [32 * k for k in Kb]
    base = _row("native", Y, [f + k for f, k in zip(Fb, Kb)], Fb, Kb)
    row = _row("oba", Y, [f + k for f, k in zip(Fo, Kb)], Fo, Kb)
    with pytest.raises(ValueError):
        oba_model.fit_alpha(row["F"], row["K"], row["R"], nbar)
    rows = derive([base, row])
    assert rows[1]["alpha_method"] == "Eq. 5" and rows[1]["alpha"] == pytest.approx(alpha, abs=0.02)
    lo, hi = rows[1]["alpha_ci"]
    assert lo <= rows[1]["alpha"] <= hi
    assert "α of oba: Eq. 5" in format_table(rows)


def test_batched_multiblock_rows_do_not_count_the_baseline_pass_timed_beside_them(monkeypatch):
    """At batch > 1 an OBA row times the baseline's pass on the same rows after each call (for r); that pass must not
    enter the row's TPS or T_den. The baseline pass here burns 0.2 s of thread-CPU time per call: counted, T_den
    would exceed it."""
    import time

    from dblock.profiling.compare import run_schedule
    from dblock.profiling import measure
    fwd = reference_forward(make_tiny_model("llada2_moe", seed=1))

    class Burning:
        def __getattr__(self, name):
            return getattr(fwd, name)

        def denoise(self, items):
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.2:
                pass
            return fwd.denoise(items)
    monkeypatch.setattr(measure, "_same_kind", lambda f: Burning())
    row = run_schedule(fwd, [[5, 6, 7], [9, 10, 11, 12, 13]], DecodeConfig(max_new_tokens=24), "oba", [0], 2)
    assert row["den_base_cpu_s"] >= 0.2          # the baseline pass ran (on calls that carried a warm-up block)
    assert row["T_den_ms"] < 200 and row["TPS"] == pytest.approx(row["Y"] / row["den_cpu_s"])
    assert row["wall_TPS"] is None


@pytest.mark.parametrize("family", ["llada2_moe", "diffusion_gemma"])
def test_the_baseline_shadow_of_an_epoch_executor_is_its_familys_class(family):
    """An OBA row of the Epoch executor times the baseline's pass on a second executor of the same kind: the
    family's own Epoch class (DiffusionGemma's is not the llada one), over the same weights, with its own caches."""
    from dblock.optimized.executor import epoch_class, epoch_forward
    from dblock.profiling import measure
    fwd = epoch_forward(make_tiny_model(family, seed=1), "full_compute")
    shadow = measure._same_kind(fwd)
    assert type(shadow) is epoch_class(fwd.model) and shadow is not fwd and shadow.model is fwd.model
    rule = "entropy-bound" if family == "diffusion_gemma" else "threshold"
    row = measure.decode_run(fwd, [[5, 6, 7], [9, 10, 11, 12, 13]], DecodeConfig(max_new_tokens=24, rule=rule), "oba",
                             1, shadow="strip", seeds=[0, 0])
    assert row["den_base_s"] is not None and row["F"] > 0
