"""The equivalence suite (docs/algorithms.md §5): differential testing of the optimized executor against the reference.
The decision margins it checks against (Γ, Γ*) are pure math beside the step rules, in `dblock.decoding.margins`.

  shadow.py      `ShadowForward`: teacher-forced comparison at every pass on identical inputs
  audit.py       `AuditedEpochExecutor`: the Epoch executor's named steps wrapped to record the audit records and
                 taps the checks read (the production executor carries none of it)
  faults.py      deliberate faults (`--inject-fault`) as overrides of the executor's named steps
  invariants.py  staleness, coverage, support-only routing, block-boundary clearing, newly-decoded-never-served,
                 LM head for every live row — pure checks over the executor's audit records
  staleness.py   the staleness curve (cosine of cached vs fresh routed outputs by age, decoded vs live rows)
  degenerate.py  exact degenerate settings: full_compute ≡ reference, paired-block proposition, world-size
  report.py      the `dblock verify` report, its text rendering and the exit-status rules
  verify.py      `run_verify`, the library entry behind `dblock verify` (dblock/cli/equivalence.py)
"""
