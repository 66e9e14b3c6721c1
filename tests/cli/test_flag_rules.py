"""Every flag takes effect or is refused by name (dblock/cli_args.py `FlagRule`).

The walk goes through every command's parser (`dblock.cli.build_parser`). For each rule attached to a command
(`flag_rules`), each of its flags is given without the mode it needs, through `dblock.cli.main` as a user's shell
would: the outcome must be exit 2 with one line naming that flag, nothing written, and fast (the refusal comes before
any model is loaded or any server binds). A second check keeps the rules complete: an option whose help says it
belongs to one mode ("epoch executor: ...", "threshold rule: ...", "with --X", "for --X", ...) must be covered by a
rule of its command, or be listed in `NOT_RULES` with the reason it needs none.
"""
from __future__ import annotations

import argparse
import re

import pytest

from dblock.cli import build_parser
from dblock.cli_args import flag_rules
from tests.fuzz.harness import check_contract, run_cli

#: a run of each command that is valid as it stands (the rules' modes as the defaults leave them)
BASE = {
    "generate": ["generate", "--model", "tiny-masked", "--prompt-ids", "5,6", "--max-new-tokens", "4"],
    "eval": ["eval", "--model", "tiny-masked", "--n", "1", "--max-new-tokens", "8"],
    "verify": ["verify", "--model", "tiny-masked", "--task", "arith", "--n", "1", "--max-new-tokens", "8"],
    "compare-schedules": ["compare-schedules", "--model", "tiny-masked", "--task", "arith", "--n", "1",
                          "--max-new-tokens", "8", "--schedules", "native"],
    "serve": ["serve", "--model", "tiny-masked", "--port", "0"],
    "train-tiny": ["train-tiny", "--family", "llada2_moe", "--size", "micro", "--batch-size", "2", "--out", "run",
                   "--steps", "1", "--no-progress"],
    "model-card": ["model-card", "--model", "tiny-masked", "--train-summary", "s.json"],
    "loadgen": ["loadgen", "--url", "http://127.0.0.1:9", "--rate", "1"],
    "simulate oba": ["simulate", "oba"],
    "simulate alpha": ["simulate", "alpha"],
    "simulate pass": ["simulate", "pass"],
    "simulate serve": ["simulate", "serve"],
    "simulate search": ["simulate", "search", "--slo", "0.1"],
    "simulate plan": ["simulate", "plan"],
    "simulate calibrate": ["simulate", "calibrate"],
    "simulate profile": ["simulate", "profile", "--model", "tiny-masked"],
    "simulate predict": ["simulate", "predict"],
    "simulate validate": ["simulate", "validate"],
}
EXECUTOR = ("generate", "eval", "verify", "compare-schedules", "serve")

#: what turns a rule's mode off where the base run leaves it on: argv appended to the base, by the rule's flags
OFF = {
    ("--epoch-config", "--refresh", "--atlas-alpha", "--atlas-q", "--update-every", "--atlas-m", "--atlas-B",
     "--atlas-beta", "--atlas-c", "--margin-refresh", "--lsp-drift", "--use-triton", "--epoch-path", "--path-profile",
     "--ep", "--ep-dispatch"): ["--executor", "reference"],
    ("--use-triton", "--epoch-path", "--path-profile", "--ep"): ["--executor", "epoch", "--epoch-config", "dense"],
    ("--atlas-alpha", "--atlas-q", "--update-every", "--atlas-m", "--atlas-B", "--atlas-beta", "--atlas-c"):
        ["--executor", "epoch", "--epoch-config", "no_atlas"],
    ("--refresh", "--lsp-drift"): ["--executor", "epoch", "--epoch-config", "no_lsp"],
    ("--margin-refresh",): ["--executor", "epoch", "--epoch-config", "full_compute"],
    ("--path-profile",): ["--executor", "epoch", "--epoch-path", "dense"],
    ("--ep-dispatch",): ["--executor", "epoch"],
    ("--threshold", "--max-steps", "--threshold-inclusive", "--threshold-steps"): ["--rule", "fixed-k"],
    ("--sampling-temperature", "--mask-policy"): ["--model", "tiny-uniform"],
    ("--no-cache",): ["--model", "tiny-uniform"],
    ("--bias-update", "--block-warmup"): ["--family", "diffusion_gemma"],
    ("--suffix-mask",): ["--family", "diffusion_gemma"],
    ("--allow-unauthenticated",): [],
    ("--duration",): ["--replay", "a.txt"],
    ("--token-ids",): ["--prompts", "ids:1,2"],
    ("--nbar", "--alpha", "--r", "--k-max", "--simulate", "--tokens", "--block", "--seed"): ["--paper"],
    ("--F", "--K", "--Y", "--R", "--nbar", "--block"): ["--paper"],
    ("--Y", "--block"): ["--K", "5"],
    ("--passes",): ["--liveness-from", "code-masked"],
    ("--rates",): ["--arrivals", "a.txt"],
    ("--model", "--hardware", "--price", "--rate", "--trace", "--prompt", "--tokens", "--passes", "--calibration",
     "--gpus-per-replica", "--max-gpus", "--plot"): ["--operator-profile", "p.json"],
    ("--hold-out", "--hardware", "--model", "--delta-from", "--gamma"): ["--cpu"],
    ("--prompt", "--tokens", "--passes", "--requests"): ["--native-trace", "t.jsonl"],
    ("--batch-size",): ["--rate", "1"],
    ("--model", "--profile", "--n", "--repeats", "--no-epoch"): ["--alpha-only"],
    ("--alpha-model", "--alpha-n"): ["--no-alpha"],
    ("--limit",): ["--json"],
}
#: rules whose mode the base run has on in a way appending cannot undo: the whole argv, by (command, rule flags)
REPLACE = {
    ("verify", ("--n", "--split")): ["verify", "--model", "tiny-masked", "--prompts", "p.txt"],
    ("compare-schedules", ("--n",)): ["compare-schedules", "--model", "tiny-masked", "--prompts", "p.txt"],
    ("simulate predict", ("--seed",)): ["simulate", "predict", "--native-trace", "t.jsonl"],
    ("eval", ("--seed",), "parse"): BASE["eval"] + ["--seeds", "0,1"],              # --seed beside --seeds
    ("loadgen", ("--url", "--rate", "--rates", "--duration", "--replay", "--prompts", "--token-ids", "--max-tokens",
                 "--seed", "--model", "--api-key", "--timeout")): ["loadgen", "--from", "r.json"],
}

#: a valid value of each flag (None: a switch)
VALUES = {
    "--epoch-config": "epoch", "--refresh": "3", "--atlas-alpha": "0.5", "--atlas-q": "0.5", "--update-every": "2",
    "--atlas-m": "1", "--atlas-B": "2", "--atlas-beta": "1", "--atlas-c": "1", "--margin-refresh": "0.1",
    "--lsp-drift": "0.1", "--use-triton": None, "--epoch-path": "epoch", "--path-profile": "pp.json", "--ep": "1",
    "--ep-dispatch": "dense", "--threshold": "0.9", "--max-steps": "8", "--threshold-inclusive": None,
    "--threshold-steps": "4", "--steps": "4", "--entropy-bound": "0.2", "--stability": "2", "--confidence": "0.01",
    "--sampling-temperature": "0.5", "--mask-policy": "official", "--no-cache": None, "--window": "2",
    "--gate": "0.5", "--top-p": "0.9", "--top-k": "5", "--seed": "3", "--schedule": "oba", "--n": "2",
    "--allow-special-tokens": None, "--split": "train", "--max-age": "4", "--plot": "x.png", "--world-sizes": "1,2",
    "--limit": "5", "--minutes": "1", "--size": "micro", "--task": "arith-small", "--add-digits": "1,2",
    "--rev-len": "1,2", "--div-digits": "2,3", "--block-size": "8", "--batch-size": "2", "--lr": "0.01",
    "--warmup": "1", "--bias-update": "0.01", "--save-every": "2", "--min-lr-frac": "0.1", "--curriculum-steps": "2",
    "--curriculum-start": "3", "--noisy-context": "0.1", "--suffix-mask": "0.5", "--init-from": "tiny-masked", "--init-first-layers": None, "--eval-every": "2",
    "--eval-n": "2", "--vocab-size": "300", "--tokenizer": "tok", "--block-warmup": "1:2", "--fused-attention": None,
    "--overwrite": None, "--schedules-batch": "4", "--allow-unauthenticated": None, "--url": "http://127.0.0.1:9",
    "--rate": "1", "--rates": "1,2", "--duration": "1", "--replay": "a.txt", "--prompts": "task:arith",
    "--token-ids": None, "--max-tokens": "8", "--model": "tiny-masked", "--api-key": "k", "--timeout": "5",
    "--nbar": "10", "--alpha": "0.5", "--r": "1.2", "--k-max": "3", "--simulate": "2", "--tokens": "const:32",
    "--block": "16", "--F": "10", "--K": "5", "--Y": "50", "--R": "2", "--responses": "10",
    "--passes": "gamma:5,0.3", "--scale": "2", "--rate-margin": "0.1", "--hardware": "h200", "--price": "h200=2",
    "--trace": "t.txt", "--prompt": "const:64", "--calibration": "none", "--gpus-per-replica": "8",
    "--max-gpus": "8", "--out": "o.json", "--hold-out": "t.jsonl", "--delta-from": "oba", "--gamma": "0.5",
    "--requests": "20", "--batch-cap": "4", "--profile": "p.json", "--repeats": "2", "--no-epoch": None,
    "--alpha-model": "code-uniform", "--alpha-n": "16", "--fit": "f.json",
}

#: options whose help names a mode but that need no rule, and why
NOT_RULES = {
    "--temperature": "both families take it, resolved per family (one number on a masked model, t_max,t_min on "
                     "DiffusionGemma); the other form is refused in decode_config (tests/cli/test_sampling_flags.py)",
    "--div-digits": "eval/train: the task refuses a size of a kind it never draws (test_task_size_of_a_kind_it_"
                    "never_draws_is_refused below)",
    "--top-p": "serve only (requests may sample whatever the server's defaults); a rule elsewhere",
    "--top-k": "serve only (requests may sample whatever the server's defaults); a rule elsewhere",
    "--plot": "simulate oba: draws in both modes (the recurrence, or with --paper the break-even map)",
    "--operator-profile": "simulate plan: it is the mode switch itself",
    "--alpha": "simulate predict: it sets the workload's kind itself (0 = masked)",
    "--family": "train-tiny --resume: refused when it differs from the run's own (test_train_state.py)",
    "--save-dtype": "train-tiny: acts on a new run and, with --resume, re-exports",
}
MODE_HELP = re.compile(r"^(epoch executor|threshold rule|entropy-bound|fixed-k|flowblock:|masked models|llada2_moe:|"
                       r"--task code|arith-long:|with --|for --|uniform-state models|staleness curve|world-size check|"
                       r"text output|where --cpu)|ignored with|for --|with --|for eq\. 4|in a text prompt|"
                       r"task/file prompts|compare-schedules batch", re.I)


def commands(p=None, path=()):
    """(command name, its parser) for every command and `simulate` subcommand."""
    p = p or build_parser()
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                if any(isinstance(x, argparse._SubParsersAction) for x in sp._actions):
                    yield from commands(sp, path + (name,))
                else:
                    yield " ".join(path + (name,)), sp


def cases():
    out = []
    for cmd, p in commands():
        for rule in flag_rules(p):
            for flag in rule.flags:
                out.append(pytest.param(cmd, rule, flag, id=f"{cmd}:{flag}:{rule.stage}:{rule.needs[:24]}"))
    return out


def argv_of(cmd: str, rule, flag: str) -> list:
    key = next((k for k in ((cmd, rule.flags, rule.stage), (cmd, rule.flags)) if k in REPLACE), None)
    if key is not None:
        argv = list(REPLACE[key])
    elif cmd == "train-tiny" and "--overwrite" in rule.flags:           # the run settings, given with --resume
        argv = ["train-tiny", "--resume", "--out", "run"]
    else:
        argv = list(BASE[cmd]) + OFF.get(rule.flags, [])
    value = VALUES[flag]
    return argv + ([flag] if value is None else [flag, value])


def test_every_rule_flag_has_a_value_and_every_command_a_base_run():
    names = {cmd for cmd, _ in commands()}
    for cmd, p in commands():
        for rule in flag_rules(p):
            assert cmd in BASE, cmd
            for f in rule.flags:
                assert f in VALUES, f"{cmd} {f}: give the test a valid value"
    assert set(EXECUTOR) <= names


@pytest.mark.parametrize("cmd, rule, flag", cases())
def test_a_flag_without_its_mode_is_refused_by_name(tmp_path, cmd, rule, flag):
    argv = argv_of(cmd, rule, flag)
    o = run_cli(argv, tmp_path, timeout_s=60.0)
    assert check_contract(o) == "refused", (argv, o.out[-300:])
    line = o.err.strip()
    assert line.startswith(f"dblock: error: {flag}"), line            # the flag is what the error is about
    assert o.seconds < 20, f"{argv}: refused only after {o.seconds:.1f} s"


def test_the_rules_cover_every_option_whose_help_names_a_mode():
    missing = []
    for cmd, p in commands():
        ruled = {f for r in flag_rules(p) for f in r.flags}
        for a in p._actions:
            if not a.option_strings or not a.help or not MODE_HELP.search(a.help):
                continue
            f = a.option_strings[-1]
            if f not in ruled and f not in NOT_RULES:
                missing.append(f"{cmd} {f}: {a.help[:80]}")
    assert not missing, "options that act in one mode without a FlagRule:\n" + "\n".join(missing)


def test_the_executor_flags_are_refused_on_every_command_that_has_them():
    for cmd, p in commands():
        if cmd in EXECUTOR:
            flags = {f for r in flag_rules(p) for f in r.flags}
            assert {"--lsp-drift", "--margin-refresh", "--use-triton", "--atlas-alpha"} <= flags, cmd


@pytest.mark.parametrize("argv", [
    BASE["generate"] + ["--executor", "epoch", "--lsp-drift", "0.1", "--margin-refresh", "0.1"],
    BASE["generate"] + ["--rule", "fixed-k", "--steps", "4"],
    BASE["generate"] + ["--schedule", "flowblock", "--window", "3", "--gate", "0.4"],
    ["generate", "--model", "tiny-uniform", "--prompt-ids", "5,6", "--max-new-tokens", "4", "--seed", "3",
     "--entropy-bound", "0.2", "--stability", "2"],
    BASE["generate"] + ["--temperature", "0.7", "--top-k", "5", "--seed", "3"],
    ["simulate", "oba", "--simulate", "2", "--tokens", "const:32", "--block", "16", "--seed", "1"],
])
def test_a_flag_in_its_mode_runs(tmp_path, argv):
    """The same flags where they act are accepted (the rules refuse only what would do nothing)."""
    o = run_cli(argv, tmp_path, timeout_s=120.0)
    assert check_contract(o) == "ok", o.err


def test_reproduce_commands_pass_the_rules():
    """What a finished run prints to reproduce itself is a command the rules accept."""
    import shlex

    from dblock.cli_args import check_flag_rules
    from dblock.tasks.train_config import TrainConfig, reproduce_command
    for cfg in (TrainConfig(out="x"), TrainConfig(out="x", family="diffusion_gemma", bias_update=0.01),
                TrainConfig(out="x", task="code", curriculum_steps=5, noisy_context=0.2, save_dtype="bfloat16"),
                TrainConfig(out="x", task="arith-long", div_digits=(2, 4), block_warmup="1:5", suffix_mask=0.5)):
        args = build_parser().parse_args(shlex.split(reproduce_command(cfg, 10))[1:])
        check_flag_rules(args)


def test_task_size_of_a_kind_it_never_draws_is_refused(tmp_path):
    for argv, flag in ((["eval", "--model", "tiny-masked", "--task", "arith", "--div-digits", "2,3"], "--div-digits"),
                       (["eval", "--model", "tiny-masked", "--task", "arith-add", "--rev-len", "1,2"], "--rev-len"),
                       (BASE["train-tiny"] + ["--task", "arith-rev", "--add-digits", "1,2"], "--add-digits")):
        o = run_cli(argv, tmp_path)
        assert check_contract(o) == "refused" and o.err.startswith(f"dblock: error: {flag}:"), o.err
