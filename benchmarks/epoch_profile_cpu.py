"""Epoch over dense on this machine, predicted by one or more operator profiles on the same measurements: the
epoch/dense rows of `dblock simulate validate` (Native decodes of `--n` held-out problems of the model's task at its
card's decoding, reference and Epoch executors at batch 8 and 32, `--repeats` interleaved repeats, thread-CPU time),
each profile scaled by its own drift re-timed between the rounds; then, for the first two profiles, the predicted
ratio with one table of the first swapped into the second (in the second's units, from their drift factors), to say
which table moves the prediction. Also the executor's Expert Atlas counters over the Epoch runs (`atlas_hot`).

    .venv/bin/python benchmarks/epoch_profile_cpu.py old=OLD.json new=NEW.json        # code-masked, about 2 min

Never used by tests.
"""
from __future__ import annotations

import argparse
import copy

import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", nargs="+", help="NAME=PATH of an operator profile of the model")
    ap.add_argument("--model", default="code-masked")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    import dblock
    from dblock.decoding.generate import reference_forward
    from dblock.decoding.params import DecodeConfig
    from dblock.optimized.executor import epoch_forward
    from dblock.simulator import batch
    from dblock.profiling import measure
    from dblock.simulator.profile import QUANTILES, Profile, ProfiledCost
    from dblock.profiling.profiler import drift
    from dblock.profiling.validate import Plan, plan_task, task_max_new
    from dblock.tasks import get_task
    from dblock.tasks.card import decoding_of
    from dblock.tasks.evaluate import TokenizerAdapter
    profs = {k: Profile.load(v) for k, v in (x.split("=", 1) for x in a.profiles)}
    m = dblock.load(a.model)
    tok = TokenizerAdapter.from_folder(m.source)
    plan = Plan(model=a.model, n=a.n)
    task = get_task(plan_task(plan, a.model))
    prompts = [tok.encode(e.prompt) for e in task.examples("test", a.n)]
    max_new = task_max_new(plan, task)
    dec = DecodeConfig(max_new_tokens=max_new, seed=plan.seed, **decoding_of(a.model))
    fw = {"reference": reference_forward(m), "epoch": epoch_forward(m, "epoch")}
    nat = measure.decode_run(fw["reference"], prompts, dec, "native", batch_size=plan.ratio_batch)
    wl = batch.Workload.from_runs(nat["prompt_lens"], max_new, nat["blocks"], m.config.block_size)
    batches = (8, 32)
    jobs = {(ex, bs): (lambda ex=ex, bs=bs: measure.decode_run(fw[ex], prompts, dec, "native", bs))
            for bs in batches for ex in ("reference", "epoch")}
    drifts = {k: [] for k in profs}

    def between():
        for k, p in profs.items():
            drifts[k].append(drift(p, m)["factor"])
    runs = measure.repeated(jobs, a.repeats, between=between)
    meas = {k: measure.median_run(v) for k, v in runs.items()}
    factor = {k: float(np.median(v)) for k, v in drifts.items()}

    def ratio(p, f, bs, q="median"):
        return (batch.simulate_batch(wl, "native", ProfiledCost(p, "epoch", q=q, scale=f), bs).tps /
                batch.simulate_batch(wl, "native", ProfiledCost(p, "reference", q=q, scale=f), bs).tps)
    for k, p in profs.items():
        f = factor[k]
        for bs in batches:
            for ex in ("reference", "epoch"):
                pt = 1e3 * batch.simulate_batch(wl, "native", ProfiledCost(p, ex, scale=f), bs).t_den
                mt = 1e3 * meas[(ex, bs)]["den_s"] / meas[(ex, bs)]["den_calls"]
                print(f"{k}: {ex} native, batch {bs}: T_den predicted {pt:.2f} ms, measured {mt:.2f} ms, "
                      f"error {100 * (pt / mt - 1):+.1f}% (drift x{f:.3f})")
            pr = {q: ratio(p, f, bs, q) for q in QUANTILES}
            rs = measure.paired_ratios(runs[("epoch", bs)], runs[("reference", bs)])
            mr = float(np.median(rs))
            sp = (np.percentile(rs, 75) - np.percentile(rs, 25)) / mr if len(rs) > 1 else float("nan")
            print(f"{k}: epoch / dense, batch {bs}: predicted {pr['median']:.3f} [{min(pr.values()):.3f}.."
                  f"{max(pr.values()):.3f}], measured {mr:.3f} (spread {100 * sp:.0f}%), "
                  f"error {100 * (pr['median'] / mr - 1):+.1f}%")
    print("Epoch runs' atlas_hot:", fw["epoch"].stats()["atlas_hot"])
    if len(profs) >= 2:
        (ka, pa), (kb, pb) = list(profs.items())[:2]
        unit = factor[ka] / factor[kb]           # pa's times in pb's units
        for name in sorted(set(pa.tables) & set(pb.tables)):
            t = copy.deepcopy(pa.tables[name])
            t._interp = {}
            for q in QUANTILES:
                setattr(t, q, getattr(t, q) * unit)
            h = Profile(dict(pb.meta), {**pb.tables, name: t})
            print(f"{kb} with {ka}'s {name}: predicted epoch / dense " +
                  ", ".join(f"batch {bs} {ratio(h, factor[kb], bs):.3f}" for bs in batches))


if __name__ == "__main__":
    main()
