"""dblock.simulator — capacity planning for block-diffusion MoE decoding, without a model or a GPU.

oba.py        closed forms of One Block Ahead (Eq. 2-6): fixed point, transient, break-even, alpha fit
positions.py  position-level model: predict alpha of a schedule from Native runs (warm-up rate delta)
decoding.py   SimPy model of Native / OBA / FlowBlock decoding for a population of requests (+ synthetic traces)
hardware.py   GPU datasheet profiles, efficiency factors, a measured `cpu` profile
cost.py       roofline cost of one pass (attention, MoE, LM head, collectives) and memory / OOM
liveness.py   live / fresh shares of a block's rows pass by pass (Epoch LSP)
serving.py    SimPy serving model: arrivals, admission, batched iterations, P95 ITL, SLO search
calibrate.py  fit profiles, alpha, r and at most two roofline factors from executor traces; predict held-out runs
papers.py     the model against the One Block Ahead and Epoch papers
profile.py    the operator profile of a machine: tables, monotone interpolation, pricing a call (CallShape)
batch.py      SimPy model of the shared driver (closed batches and serving), priced call by call; decompose
fingerprint.py  what a profile was measured on: the machine tag, the fingerprint of the executors' source
plan.py       the cheapest deployment meeting P95 ITL / TTFT objectives; plan_profiled.py prices it with a profile
gpufit.py     the GPU cost model's terms fitted on published measurements (published.py: the data's schema)

Every module imports only dblock.config, dblock.trace, the decoding defaults it simulates and scientific
libraries, never a model or an executor (pyproject.toml's import-linter contracts hold it). The measuring side,
which loads models and runs executors (`simulate profile`, `simulate validate`, thread-CPU timing), is
dblock/profiling/; the commands are dblock/cli/simulator.py.
"""
