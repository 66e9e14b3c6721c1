"""dblock.profiling — executors run and timed, to measure what the simulator predicts.

The simulator (dblock/simulator/) models decoding and serving without a model; this room is its measuring side,
which loads models and drives executors. It sits above the executor rooms, the tasks and the serving engine, and
below the command line.

measure.py         thread-CPU timing of Forward calls (`TimedForward`), r on the same rows, decode runs, paired
                   ratios and noise bands, serving on a CPU-time clock
profiler.py        the operator profile of a model on this machine (`simulate profile`): every op timed on a grid
profiler_epoch.py  the Epoch executor's passes timed for that profile (decoded and synthetic passes)
validate.py        the profile's predictions checked against measured runs (`simulate validate`)
compare.py         `dblock compare-schedules`' library side: every schedule on the same requests, OBA paper
                   quantities, paired bootstrap intervals, timed passes
"""
