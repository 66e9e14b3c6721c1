"""`dblock simulate oba|alpha|pass|serve|search|plan|calibrate ...` — thin: parse, call the library, print.

`dblock.cli` calls `add_parser(subparsers)`; each `simulate` subcommand runs its `set_defaults(_run=...)` function.
Errors are `ValueError`s with one clear message; the top-level CLI prints them as one line. Numeric flags carry
their ranges in their argparse types (`dblock.cli_args.int_arg`, `float_arg`): NaN, inf and out-of-range values are
refused at parse time, naming the flag. Work that would not finish (`oba --simulate` on a workload of more than
`simulator_oba.MAX_SIM_PASSES` denoising passes) is refused before it starts.

One module per subcommand group, each adding its subcommands (`add_parsers`) and holding their run functions:
`simulator_oba` (oba, alpha: the One Block Ahead closed forms and α), `simulator_roofline` (pass, serve, search:
the roofline pass cost and the SimPy serving model over it), `simulator_plan` (plan: the cheapest deployment meeting
an SLO), `simulator_profile` (calibrate, profile, predict, validate: the simulator fitted to this machine, measured
by dblock/profiling/), `simulator_published` (calibrate and validate `--published`); `simulator_common` holds their
shared flag parsing and output.
"""
from __future__ import annotations

import argparse
import sys

from dblock.cli_args import ArgumentParser, seed_arg
from dblock.cli import simulator_oba, simulator_plan, simulator_profile, simulator_roofline


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="capacity planning: OBA closed forms, alpha, pass cost, serving",
                              description="Simulate block-diffusion MoE decoding and serving (see SIMULATOR.md).")
    sub = p.add_subparsers(dest="sim_command",
                           metavar="{oba,alpha,pass,serve,search,plan,calibrate,profile,predict,validate}")
    sub.required = True

    def common(sp):
        sp.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
        sp.add_argument("--seed", type=seed_arg, default=0,
                        help="random seed of every simulation, in [0, 2**63-1] (default 0)")

    simulator_oba.add_parsers(sub, common)
    simulator_roofline.add_parsers(sub, common)
    simulator_plan.add_parsers(sub, common)
    simulator_profile.add_parsers(sub, common)
    return p


def main(args) -> int:
    """Run a parsed `simulate` subcommand (what `dblock.cli.main` does, without its error handling)."""
    return args._run(args)


def _standalone(argv=None) -> int:  # pragma: no cover - `python -m dblock.cli.simulator` for quick use
    parser = ArgumentParser(prog="dblock")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    try:
        return main(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_standalone())
