"""`run_verify`: the library entry behind `dblock verify` — shadow comparison, liveness probe, invariants,
end-to-end agreement, staleness curve and degenerate checks, gathered into one report (`report.py`).

Runs, in order:
  1. main     the user's workload (prompts, decode config, schedule) through `ShadowForward`: the optimized
              executor drives the trajectory, the reference shadows every pass on the same inputs.
  2. probe    a *liveness probe*: the first prompts again under the fixed-k rule with one position per pass
              (steps = C), so every block lasts C passes and decoded rows stay stable for many passes. A quickly
              decoding model may finish most blocks in 2-3 passes, where no cache entry ever reaches the age bound;
              the probe makes sure the staleness, refresh and newly-decoded paths are exercised at their limits
              (a healthy executor reads entries up to age M_C - 1 there). Its invariants count toward the exit
              status; its decision agreement is reported, not gated (fixed-k has its own, smaller margins).
  3. e2e      a separate reference run of the same workload: per-request token agreement with the optimized
              trajectory and, with a task, the accuracy of both (the optimized trajectory *is* the optimized
              executor's output: the shadow only observes).
  4. staleness (optional) the lagged and served cosine curves, table + PNG.
  5. checks   (optional) the degenerate exactness checks of `degenerate.py`.
"""
from __future__ import annotations

import os
import time
from typing import Optional, Sequence

from dblock.decoding.params import DecodeConfig
from dblock.equivalence import report as rpt
from dblock.equivalence.shadow import ShadowForward, shadow_generate


def make_optimized(model, executor: str, config: str, epoch_kw: dict, faults: Sequence[str]):
    """The executor under test: the reference itself, or the audited Epoch executor with `faults` injected."""
    from dblock.equivalence.audit import audited_epoch_forward
    from dblock.decoding.generate import reference_forward
    if executor == "reference" or config == "dense":
        if faults:
            raise ValueError("--inject-fault needs --executor epoch with an epoch configuration (not dense)")
        return reference_forward(model)
    return audited_epoch_forward(model, config, faults=tuple(faults), **epoch_kw)


def probe_decode(dec: DecodeConfig, block_size: int) -> DecodeConfig:
    """Fixed-k, one position per pass: blocks last C passes."""
    C = dec.block_size or block_size
    return dec.replace(rule="fixed-k", steps=C, max_new_tokens=min(dec.max_new_tokens, 2 * C), threshold_steps=None)


def _fault_exercise(faults, main, probe) -> dict:
    """Why a fault might not show (for the self-check's message)."""
    out = {}
    for f in faults:
        if f == "stale-cache":
            out[f] = ("no cache entry reached age M_C: blocks too short even in the probe; try --refresh 2"
                      if not probe else "the probe never reached age M_C")
        elif f == "cache-newly-decoded":
            out[f] = "no hot pass decoded a position (every block finished on its cold pass?)"
        elif f == "route-outside-support":
            out[f] = "no strict support was built (--epoch-config without Expert Atlas?)"
        elif f == "drift-unchecked":
            out[f] = "no served row's MoE input moved past ε (try a smaller --lsp-drift)"
        else:
            out[f] = "no live row was skipped"
    return out


def run_verify(model, prompts: list, dec: DecodeConfig, schedule: str = "native", executor: str = "epoch",
               config: str = "epoch", epoch_kw: Optional[dict] = None, faults: Sequence[str] = (),
               probe: bool = True, e2e: bool = True, task=None, task_examples=None, tokenizer=None,
               staleness_ages: int = 0, plot_path: Optional[str] = None, checks: Sequence[str] = (),
               world_sizes=(1, 2, 4), max_disagreement: Optional[float] = None, batch_size: Optional[int] = None,
               model_name: str = "", progress=None) -> dict:
    """Everything `dblock verify` reports, as a dict with `exit` = {"status", "reasons"} (see report.py)."""
    from dblock.decoding.generate import generate, reference_forward
    from dblock.decoding.schedules import schedule_spec

    t0 = time.perf_counter()
    epoch_kw = {k: v for k, v in (epoch_kw or {}).items() if v is not None}
    for f in faults:
        if f not in rpt.FAULTS:
            raise ValueError(f"--inject-fault {f}: allowed {', '.join(rpt.FAULTS)}")
    cfg = model.config
    no_cache = [f for f in faults if f in ("stale-cache", "cache-newly-decoded")]
    if no_cache and getattr(cfg, "mask_token_id", None) is None:
        raise ValueError(f"--inject-fault {no_cache[0]}: {cfg.family} is uniform-state and runs without LSP (no "
                         "decoded-output cache for the fault to corrupt); allowed here: route-outside-support, "
                         "skip-live-logits")
    if "drift-unchecked" in faults and (executor == "reference" or epoch_kw.get("lsp_drift") is None):
        raise ValueError("--inject-fault drift-unchecked: the fault skips LSP's drift bound; give the epoch executor "
                         "one with --lsp-drift EPS")
    spec = schedule_spec(schedule) if isinstance(schedule, str) else schedule
    ex_name = "reference" if executor == "reference" else "epoch"
    cfg_name = "reference" if executor == "reference" else config
    if max_disagreement is None:
        max_disagreement = rpt.default_max_disagreement(cfg_name)
    say = progress or (lambda msg: None)
    ref = reference_forward(model)

    rep = {"model": model_name or getattr(model, "source", "") or cfg.family, "family": cfg.family,
           "executor": ex_name, "epoch_config": cfg_name,
           "epoch_kw": {k: (v.as_dict() if hasattr(v, "as_dict") else v) for k, v in epoch_kw.items()
                        if k != "dispatcher"}, "schedule": spec.name,
           "decode": {k: getattr(dec, k) for k in ("rule", "threshold", "max_steps", "steps", "block_size",
                                                   "max_new_tokens", "no_cache")},
           "requests": len(prompts), "faults": list(faults), "max_disagreement": max_disagreement}

    # 1) main shadow run
    say("shadow run")
    opt = make_optimized(model, executor, config, epoch_kw, faults)
    main = ShadowForward(opt, ref, staleness_ages=staleness_ages, label="main")
    run = shadow_generate(main, prompts, dec, spec, batch_size)
    rep["main"] = rpt.shadow_section(main, opt)

    # 2) liveness probe
    probe_sh = None
    if probe and getattr(opt, "audit", None) is not None and getattr(cfg, "mask_token_id", None) is None:
        # uniform-state (DiffusionGemma): no decoded row before commit, LSP is off, no cache to exercise; and
        # the probe's fixed-k rule is a masked-diffusion rule
        rep["probe_decode"] = "skipped: uniform-state model (LSP off, no decoded-output cache to exercise)"
    elif probe and getattr(opt, "audit", None) is not None:       # an executor with a cache to exercise
        say("liveness probe")
        pdec = probe_decode(dec, cfg.block_size)
        popt = make_optimized(model, executor, config, epoch_kw, faults)
        probe_sh = ShadowForward(popt, ref, staleness_ages=staleness_ages, label="probe")
        shadow_generate(probe_sh, prompts[:2], pdec, "native", batch_size)
        rep["probe"] = rpt.shadow_section(probe_sh, popt)
        rep["probe_decode"] = f"fixed-k, steps {pdec.steps} (one position per pass), {min(2, len(prompts))} " \
                              f"prompts, max_new_tokens {pdec.max_new_tokens}"

    # 3) end to end
    if e2e:
        say("end-to-end reference run")
        ref_res = generate(ref, prompts, dec, spec, batch_size=batch_size)
        same = sum(a == b for a, b in zip(ref_res.tokens, run.tokens))
        match = total = 0
        for a, b in zip(ref_res.tokens, run.tokens):
            total += max(len(a), len(b))
            match += sum(x == y for x, y in zip(a, b))
        e = {"requests": len(prompts), "identical": same, "token_agreement": match / total if total else 1.0,
             "reference_Y": sum(c.Y for c in ref_res.counters), "optimized_Y": sum(c.Y for c in run.counters),
             "reference_F": sum(c.F for c in ref_res.counters), "optimized_F": sum(c.F for c in run.counters)}
        if task is not None and task_examples is not None and tokenizer is not None:
            from dblock.tasks import answer_text
            acc_r = sum(task.grade(ex.prompt, answer_text(t, tokenizer)) for ex, t in zip(task_examples,
                                                                                         ref_res.tokens))
            acc_o = sum(task.grade(ex.prompt, answer_text(t, tokenizer)) for ex, t in zip(task_examples, run.tokens))
            n = len(task_examples)
            e.update(task=getattr(task, "name", str(task)), accuracy_reference=acc_r / n, accuracy_optimized=acc_o / n,
                     accuracy_delta=(acc_o - acc_r) / n)
        rep["e2e"] = e

    # 4) staleness curve
    if staleness_ages:
        from dblock.equivalence.staleness import plot, staleness_table
        M = getattr(getattr(opt, "ecfg", None), "refresh", None)
        tables = {"main": staleness_table(main, staleness_ages, M)}
        if probe_sh is not None:
            tables["probe"] = staleness_table(probe_sh, staleness_ages, M)
        st = {"tables": tables}
        if plot_path:
            d = os.path.dirname(os.path.abspath(plot_path))
            os.makedirs(d, exist_ok=True)
            st["plot"] = plot(tables, plot_path, M, title=f"Staleness of routed-expert outputs — {rep['model']} "
                                                          f"({cfg_name}, M_C = {M})")
        rep["staleness"] = st

    # 5) degenerate checks
    if checks:
        from dblock.equivalence import degenerate as dg
        rep["checks"] = {}
        for name in checks:
            say(f"check {name}")
            if name == "full-compute":
                rep["checks"][name] = dg.check_full_compute(model, prompts, dec, spec, batch_size)
            elif name == "paired-block":
                rep["checks"][name] = dg.check_paired_block(model, prompts, dec, batch_size)
            elif name == "world-size":
                rep["checks"][name] = dg.check_world_sizes(getattr(model, "source", None), prompts, dec,
                                                           world_sizes, config if ex_name == "epoch" else "epoch",
                                                           spec.name, epoch_kw)
            else:
                raise ValueError(f"--check {name}: allowed full-compute, paired-block, world-size, all")

    rep["fault_exercise"] = _fault_exercise(faults, main, probe_sh)
    status, reasons = rpt.verdict(rep, max_disagreement, faults)
    rep["exit"] = {"status": status, "reasons": reasons}
    rep["wall_s"] = time.perf_counter() - t0
    return rep
