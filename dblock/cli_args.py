"""The argparse side every `dblock` command shares: the parser with one-line errors, the numeric flag types with
their ranges, and the option groups (`--model`, the decoding flags, the executor flags).

`dblock.cli` builds the command tree; each room's command module (`dblock/cli/<room>.py`) imports its option groups from
here, never from `dblock.cli`, so the tree has no import cycle. Nothing heavy at import (argparse, math, os and sys
only): `dblock --help` and `dblock <command> --help` import no torch.

Every numeric flag has an argparse `type` with its allowed range (`int_arg`, `float_arg`, `seed_arg`,
`temperature_arg`, `seeds_arg`); a value out of range, NaN, inf or of the wrong type stops the parse with one line
naming the flag, the value and the range (`ArgumentParser.error` prints `dblock: error: ...`, exit 2).

What the parsed flags become lives next to what they serve, each module as light at import as this one: the
decoding flags as a `DecodeConfig` and a schedule, checked against the model's config.json before the weights are
read (`dblock.decode_flags`); `--model`, `--device`, `--dtype` and the executor flags as a config, a loaded model
and a Forward (`dblock.model_flags`); text prompts as token ids (`dblock.prompts`); output paths checked before any
work (`dblock.out_paths`); which torchrun rank prints (`dblock.ranks`).

The ranges are the serving API's (dblock/serving/protocol.py): seeds in [0, 2**63-1], and a request must fit the
model's positions (dblock/serving/engine.py `footprint`).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

#: seeds (--seed, --seeds) are torch generator seeds: a signed 64-bit integer, as the serving API's `seed`
MAX_SEED = 2 ** 63 - 1
#: passes per block (--steps, --max-steps) and the stop rule's history length (--stability)
MAX_STEPS = 4096
#: a static ceiling on token counts (--max-new-tokens, --block-size) before the model's own positions bound them
MAX_TOKENS = 1 << 24
#: requests per forward (--batch-size) and problems per run (--n)
MAX_BATCH = 1 << 20
MAX_PROBLEMS = 1_000_000


# ---------------------------------------------------------------------------------------------------------------
# the parser: one-line errors
# ---------------------------------------------------------------------------------------------------------------

class ArgumentParser(argparse.ArgumentParser):
    """argparse with dblock's error format: a usage error is one line on stderr, `dblock: error: ...` naming the
    flag and the command whose --help explains it, exit status 2. A value refused by one of the types below reads
    `--flag VALUE: reason and the allowed range`; argparse's own errors (unknown flag, invalid choice, missing
    value) keep argparse's text. Subcommand parsers inherit the class (argparse builds them with the parent's
    type)."""

    def error(self, message):
        text = " ".join(str(message).split())
        if text.startswith("argument ") and _VALUE_MARK in text:     # `argument -x/--flag: <mark>VALUE: reason`
            names, _, rest = text[len("argument "):].partition(": " + _VALUE_MARK)
            text = f"{names.split('/')[-1]} {rest}"
        self.exit(2, f"dblock: error: {text} (see `{self.prog} --help`)\n")

    # Which options the command line gave (not their defaults): `given(args, dest)`. argparse converts the values of
    # an option that is present through `_get_values`, and only then; a subcommand's parser records its own and
    # argparse copies its namespace, `GIVEN` included, into the parent's.
    def parse_known_args(self, args=None, namespace=None):
        self._given = set()
        ns, rest = super().parse_known_args(args, namespace)
        setattr(ns, GIVEN, frozenset(getattr(ns, GIVEN, frozenset()) | self._given))
        return ns, rest

    def _get_values(self, action, arg_strings):
        if action.option_strings:
            self._given.add(action.dest)
        return super()._get_values(action, arg_strings)


#: the types' messages start with it, so that `ArgumentParser.error` can put the flag in front of the value
_VALUE_MARK = "= "

#: the parsed namespace's attribute holding the dests of the options the command line gave
GIVEN = "_given"


def given(args, dest: str) -> bool:
    """Whether the command line gave option `dest` (a namespace not built by `ArgumentParser`: never)."""
    return dest in getattr(args, GIVEN, ())


# ---------------------------------------------------------------------------------------------------------------
# the flag rule: every flag takes effect or is refused by name
# ---------------------------------------------------------------------------------------------------------------

class FlagRule:
    """Options that act only in one mode of their command (an executor, a schedule, a rule, another flag).

    `flags`: the options, as spelled on the command line (`--lsp-drift`); `needs`: the mode, as a phrase that
    completes "applies only ..." (`with --executor epoch (the reference executor has no LSP)`); `active(args, ctx)`:
    whether that mode is on for these parsed arguments. `stage` "parse" rules are checked by `dblock.cli.main` right
    after parsing, before anything runs; rules whose mode depends on the model (its family, the step rule it
    decodes with) are checked where that is known, with what is known as `ctx` (`dblock.decode_flags`:
    `stage="decode"`, ctx `family`, `rule`, `sampling`). A given option whose mode is off is a `ConfigError`
    naming it: it would do nothing. Commands attach their rules with `add_flag_rules`; tests/cli/test_flag_rules.py
    walks every command's parser and gives each such option without its mode."""

    def __init__(self, flags, needs: str, active, stage: str = "parse", dests: dict | None = None):
        self.flags = (flags,) if isinstance(flags, str) else tuple(flags)
        self.needs, self.active, self.stage = needs, active, stage
        self.dests = dict(dests or {})         # flag -> its argparse dest, filled by `add_flag_rules`

    def __repr__(self):
        return f"FlagRule({', '.join(self.flags)}: {self.needs})"


def add_flag_rules(p, *rules: FlagRule) -> None:
    """Attach `rules` to parser `p` (kept in its defaults as `_flag_rules`, beside the rules already there). Each
    flag must already be an option of `p` (a misspelt rule fails here, when the parser is built)."""
    bound = []
    for r in rules:
        dests = {}
        for f in r.flags:
            if f not in p._option_string_actions:
                raise ValueError(f"flag rule {r}: {p.prog} has no option {f}")
            dests[f] = p._option_string_actions[f].dest
        bound.append(FlagRule(r.flags, r.needs, r.active, r.stage, dests))
    p.set_defaults(_flag_rules=tuple(p.get_default("_flag_rules") or ()) + tuple(bound))


def flag_rules(p) -> tuple:
    """The rules attached to parser `p`."""
    return tuple(p.get_default("_flag_rules") or ())


def check_flag_rules(args, stage: str = "parse", **ctx) -> None:
    """Refuse the first option the command line gave whose rule of `stage` says its mode is off (see `FlagRule`)."""
    from dblock.errors import ConfigError
    for rule in getattr(args, "_flag_rules", ()) or ():
        if rule.stage != stage:
            continue
        gave = [f for f in rule.flags if given(args, rule.dests[f])]
        if gave and not rule.active(args, ctx):
            raise ConfigError(f"{gave[0]}: applies only {rule.needs}; here it would do nothing (refused, not ignored)")


class ValueRefused(argparse.ArgumentTypeError):
    """A flag's value out of its range; the message is `VALUE: reason`."""

    def __init__(self, value, reason: str):
        super().__init__(f"{_VALUE_MARK}{_show(value)}: {reason}")


def _show(s) -> str:
    """A value as the user typed it, kept short."""
    try:
        s = str(s)
    except ValueError:            # an int beyond str()'s digit limit
        return "<a huge integer>"
    return s if len(s) <= 60 else s[:57] + "..."


def _range_text(lo, hi, lo_open=False, hi_open=False) -> str:
    """`in [lo, hi]` / `in (lo, hi]` / `>= lo`: the allowed range, for messages."""
    if hi is None:
        return f"> {lo:g}" if lo_open else f">= {lo:g}"
    return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def int_arg(lo: int, hi: int | None = None, hi_text: str | None = None, allowed: str | None = None):
    """argparse `type`: an integer in [lo, hi] (hi None: no upper bound). `hi_text` spells hi in messages;
    `allowed` replaces the "give an integer in ..." phrase."""
    rng = f"in [{lo}, {hi_text or hi}]" if hi is not None else f">= {lo}"
    give = allowed or f"give an integer {rng}"

    def parse(s):
        try:
            v = int(str(s).strip())
        except ValueError:
            digits = str(s).strip().lstrip("+-")
            why = "out of range" if digits.isdigit() and digits.isascii() else "not an integer"
            raise ValueRefused(s, f"{why}: {give}") from None
        if v < lo or (hi is not None and v > hi):
            why = ("must be positive" if lo == 1 and v < 1 else "must be >= 0" if lo == 0 and v < 0 else
                   "out of range")
            raise ValueRefused(v, f"{why}: {give}")
        return v
    parse.__name__ = "int"
    return parse


def float_arg(lo: float, hi: float | None = None, lo_open: bool = False, hi_open: bool = False):
    """argparse `type`: a finite number in the interval (NaN and inf are refused)."""
    rng = _range_text(lo, hi, lo_open, hi_open)

    def parse(s):
        try:
            v = float(str(s).strip())
        except ValueError:
            raise ValueRefused(s, f"not a number: give a number {rng}") from None
        if not math.isfinite(v):
            raise ValueRefused(s, f"not a finite number: give a number {rng}")
        if v < lo or (lo_open and v == lo) or (hi is not None and (v > hi or (hi_open and v == hi))):
            raise ValueRefused(s, f"out of range: give a number {rng}")
        return v
    parse.__name__ = "float"
    return parse


def bound_arg(s):
    """argparse `type`: a bound >= 0, or inf."""
    try:
        v = float(str(s).strip())
    except ValueError:
        raise ValueRefused(s, "not a number: give a number >= 0, or inf") from None
    if math.isnan(v) or v < 0:
        raise ValueRefused(s, "out of range: give a number >= 0, or inf")
    return v


seed_arg = int_arg(0, MAX_SEED, "2**63-1")
seed_arg.__doc__ = "argparse `type`: a seed in [0, 2**63-1]."

port_arg = int_arg(0, 65535, allowed="give a TCP port in [1, 65535], or 0 for any free port (printed at startup)")
port_arg.__doc__ = "argparse `type`: a TCP port in [1, 65535], or 0 (the system picks a free one)."


def seeds_arg(s):
    """argparse `type`: comma-separated seeds, each in [0, 2**63-1]."""
    items = [x for x in str(s).replace(" ", "").split(",") if x != ""]
    if not items:
        raise ValueRefused(s, "give comma-separated integers, e.g. 0,1,2")
    out = []
    for x in items:
        try:
            v = int(x)
        except ValueError:
            raise ValueRefused(s, f"{_show(x)!r} is not an integer: give comma-separated seeds in [0, 2**63-1]") \
                from None
        if not 0 <= v <= MAX_SEED:
            raise ValueRefused(s, f"seed {_show(v)} is out of range: give seeds in [0, 2**63-1]")
        out.append(v)
    return out


#: temperatures of the entropy-bound rule: T divides the logits, so a value near 0 overflows them to inf
TEMPERATURE_MIN, TEMPERATURE_MAX = 1e-3, 1e3


def temperature_arg(s):
    """argparse `type`: `t_max,t_min`, two finite numbers in [1e-3, 1e3] with t_max >= t_min (the entropy-bound
    rule's temperature falls from t_max at the first step to t_min at the last, dblock/decoding/entropy_bound.py;
    t_max == t_min, a constant temperature, is allowed)."""
    parts = str(s).replace(" ", "").split(",")
    try:
        vals = [float(x) for x in parts]
    except ValueError:
        vals = []
    if len(vals) != 2:
        raise ValueRefused(s, "give t_max,t_min, e.g. 0.8,0.4")
    rng = f"[{TEMPERATURE_MIN:g}, {TEMPERATURE_MAX:g}]"
    for name, v in zip(("t_max", "t_min"), vals):
        if not math.isfinite(v) or not TEMPERATURE_MIN <= v <= TEMPERATURE_MAX:
            why = "not finite" if not math.isfinite(v) else "out of range"
            raise ValueRefused(s, f"{name}={v:g} is {why}: give t_max,t_min, finite numbers in {rng}")
    if vals[0] < vals[1]:
        raise ValueRefused(s, f"t_max={vals[0]:g} < t_min={vals[1]:g}: the temperature falls from t_max to t_min, so "
                              "give t_max >= t_min (equal: constant)")
    return tuple(vals)


#: the masked families' sampling temperature (dblock/decoding/params.py): 0 = greedy, else [1e-4, 1e4]
SAMPLING_TEMPERATURE_MIN, SAMPLING_TEMPERATURE_MAX = 1e-4, 1e4


def sampling_temperature_arg(s):
    """argparse `type`: the masked families' token-sampling temperature, 0 (greedy) or a finite number in
    [1e-4, 1e4] (dblock/decoding/params.py `check_temperature`)."""
    rng = f"0 (greedy) or a number in [{SAMPLING_TEMPERATURE_MIN:g}, {SAMPLING_TEMPERATURE_MAX:g}]"
    try:
        v = float(str(s).strip())
    except ValueError:
        raise ValueRefused(s, f"not a number: give {rng}") from None
    if not math.isfinite(v):
        raise ValueRefused(s, f"not a finite number: give {rng}")
    if not (v == 0 or SAMPLING_TEMPERATURE_MIN <= v <= SAMPLING_TEMPERATURE_MAX):
        raise ValueRefused(s, f"out of range: give {rng}")
    return v


def temperature_flag_arg(s):
    """argparse `type` of `--temperature`: one number T (float: the masked families' sampling temperature, as
    `sampling_temperature_arg`) or `t_max,t_min` (tuple: DiffusionGemma's entropy-bound schedule, as
    `temperature_arg`). Which one the model takes is decided in `decode_config`, per family."""
    if "," not in str(s):
        try:
            return sampling_temperature_arg(s)
        except argparse.ArgumentTypeError:
            raise ValueRefused(s, "give one number T (masked models: sampling temperature, 0 = greedy, or in "
                                  f"[{SAMPLING_TEMPERATURE_MIN:g}, {SAMPLING_TEMPERATURE_MAX:g}]) or t_max,t_min "
                                  "(DiffusionGemma, e.g. 0.8,0.4)") from None
    return temperature_arg(s)


def token_ids_arg(s):
    """argparse `type`: comma-separated token ids (integers >= 0), e.g. 1,7."""
    items = [x for x in str(s).replace(" ", "").split(",") if x != ""]
    if not items:
        raise ValueRefused(s, "give comma-separated token ids (integers >= 0), e.g. 1,7")
    out = []
    for x in items:
        try:
            v = int(x)
        except ValueError:
            raise ValueRefused(s, f"{_show(x)!r} is not an integer: give comma-separated token ids (integers >= 0)") \
                from None
        if v < 0:
            raise ValueRefused(s, f"token id {v} is negative: give token ids >= 0")
        if v >= MAX_TOKENS:
            raise ValueRefused(s, f"token id {_show(v)} is out of range: give token ids below the vocabulary size")
        out.append(v)
    return out


# ---------------------------------------------------------------------------------------------------------------
# option groups
# ---------------------------------------------------------------------------------------------------------------

def add_model_args(p, required=True):
    p.add_argument("--model", required=required,
                   help="model folder (HF config.json + safetensors), bundled name (tiny-masked, tiny-uniform), or a "
                        "Hugging Face id org/name[@revision] already in the local HF cache (never downloaded)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float64", "float16"],
                   help="compute dtype (default: float32 on cpu, the stored dtype on cuda)")


def add_special_tokens_arg(p):
    p.add_argument("--allow-special-tokens", action="store_true",
                   help="let the literal text of a special token in a text prompt (<eos>, <mask>, ...) become that "
                        "control token (default: it is plain text)")


def resolve_max_new_tokens(args, task=None) -> None:
    """A command whose parser leaves --max-new-tokens unset (None: `eval`, `verify`, `compare-schedules`) generates
    the task's own length (`task.max_new_tokens`: the code task's 64) or 128."""
    if getattr(args, "max_new_tokens", 0) is None:
        args.max_new_tokens = getattr(task, "max_new_tokens", None) or 128


def add_decode_args(p, serving: bool = False):
    """The decoding flags, with their rules (`DECODE_RULES`; `SAMPLING_RULES` unless `serving`)."""
    g = p.add_argument_group("decoding")
    g.add_argument("--max-new-tokens", type=int_arg(1, MAX_TOKENS), default=128,
                   help="generation budget per request (default 128; prompt + budget must fit the model's positions)")
    g.add_argument("--block-size", type=int_arg(1, MAX_TOKENS), default=None,
                   help="block size C (default: the model's; at most its max_position_embeddings)")
    g.add_argument("--rule", default=None, choices=["threshold", "fixed-k", "entropy-bound"],
                   help="step rule (default: threshold for masked models, entropy-bound for uniform-state)")
    g.add_argument("--threshold", type=float_arg(0.0, 1.0, lo_open=True), default=0.95,
                   help="threshold rule: commit when confidence > tau, tau in (0, 1] (--threshold-inclusive: >=)")
    g.add_argument("--max-steps", type=int_arg(1, MAX_STEPS), default=64,
                   help=f"threshold rule: passes per block before commit-all (1..{MAX_STEPS})")
    g.add_argument("--steps", type=int_arg(1, MAX_STEPS), default=None,
                   help="fixed-k: passes per block (default 32); entropy-bound: denoising steps N (default 48); "
                        f"1..{MAX_STEPS}")
    g.add_argument("--no-cache", action="store_true",
                   help="llada2_moe: recompute the whole prefix every pass instead of the exact KV cache")
    g.add_argument("--seed", type=seed_arg, default=0,
                   help="noise seed in [0, 2**63-1] (uniform-state; Native: same stream as torch.manual_seed(S) + "
                        "transformers; masked models: the sampling draws when --temperature > 0)")
    g.add_argument("--entropy-bound", type=float_arg(0.0), default=0.1,
                   help="entropy-bound rule: budget b >= 0 (default 0.1)")
    g.add_argument("--temperature", type=temperature_flag_arg, default=None,
                   help="masked models: one number T, the token sampling temperature (the same as "
                        "--sampling-temperature; default 0 = greedy); DiffusionGemma (entropy-bound rule): t_max,t_min "
                        f"with t_max >= t_min, each in [{TEMPERATURE_MIN:g}, {TEMPERATURE_MAX:g}] (default 0.8,0.4; "
                        "T,T is a constant temperature). A pair on a masked model or one number on DiffusionGemma is "
                        "refused")
    g.add_argument("--stability", type=int_arg(0, MAX_STEPS), default=1,
                   help="entropy-bound stop: argmax stable for this many steps")
    g.add_argument("--confidence", type=float_arg(0.0), default=0.005,
                   help="entropy-bound stop: mean entropy below this (>= 0)")
    g.add_argument("--schedule", default="native",
                   help="native | native2c | oba | dense_mask | flowblock | drop_time | keep_signal | keep_tokens "
                        "| no_accept | no_signal (default native)")
    g.add_argument("--window", type=int_arg(2, 4), default=None, help="flowblock: blocks in flight W (2..4, default 2)")
    g.add_argument("--gate", type=float_arg(0.0, 1.0), default=None,
                   help="flowblock: readiness gate gamma in [0, 1] (default 0.5)")
    # masked models' sampler and upstream parity options (docs/algorithms.md §2.1, §2.4, §2.5)
    g.add_argument("--sampling-temperature", type=sampling_temperature_arg, default=None,
                   help="masked models: token sampling temperature (0 = greedy argmax; > 0 samples from softmax(z/T) "
                        "after --top-k/--top-p, confidence = the sampled token's probability, as LLaDA2.0); "
                        "DiffusionGemma uses --temperature t_max,t_min")
    g.add_argument("--top-p", type=float_arg(0.0, 1.0, lo_open=True), default=None,
                   help="masked models, with --temperature > 0: nucleus filter p in (0, 1] (default 1 = off)")
    g.add_argument("--top-k", type=int_arg(0, MAX_TOKENS), default=None,
                   help="masked models, with --temperature > 0: keep the k most likely tokens (default 0 = off)")
    g.add_argument("--threshold-inclusive", action="store_true",
                   help="threshold rule: commit when confidence >= tau (dblock's earlier rule; default > tau, as "
                        "LLaDA2.0)")
    g.add_argument("--threshold-steps", type=int_arg(0, MAX_STEPS), default=None,
                   help="threshold rule: LLaDA2.0's steps S, each pass commits at least its share of the block "
                        f"(1..{MAX_STEPS}; 0 = off; default: the model card's `decoding`, else off)")
    g.add_argument("--mask-policy", default="exclude", choices=["exclude", "official", "ineligible"],
                   help="masked models: may the MASK id be predicted: exclude (default; never), official (LLaDA, "
                        "LLaDA2.0: yes, a MASK commit is wasted), ineligible (dInfer: such a row cannot commit)")
    # stop conditions, both families (docs/algorithms.md §2.6)
    g.add_argument("--stop-token-ids", type=token_ids_arg, default=None,
                   help="more token ids that end generation like EOS, comma-separated (kept in the output)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT_OR_IDS",
                   help="a stop sequence, repeatable: text (tokenized with the model's tokenizer.json) or token ids "
                        "ID,ID; 'text:...' forces text, 'ids:...' ids. Generation ends at its first occurrence, "
                        "kept in the output like EOS")
    g.add_argument("--min-tokens", type=int_arg(0, MAX_TOKENS), default=0,
                   help="no stop (EOS, stop id, stop sequence) before this many generated tokens (<= "
                        "--max-new-tokens; default 0)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="EOS does not end generation (stop ids and --stop still do): decode to --max-new-tokens")
    add_flag_rules(p, *DECODE_RULES, *([] if serving else SAMPLING_RULES))


def _schedule_names(a) -> list:
    """The schedules a command runs: --schedule, or compare-schedules' --schedules (default: all, FlowBlock too)."""
    if hasattr(a, "schedules"):
        return [s.strip() for s in str(a.schedules or "flowblock").split(",")]
    return [str(getattr(a, "schedule", "native"))]


#: the decoding flags that act in one mode only: the step rule (known once the model's family is: stage "decode",
#: checked by `dblock.decode_flags.decode_config` with ctx family, rule and sampling = the masked sampling
#: temperature) and the schedule
DECODE_RULES = (
    FlagRule(("--threshold", "--max-steps", "--threshold-inclusive", "--threshold-steps"),
             "to the threshold rule (--rule threshold, the masked models' default)",
             lambda a, c: c["rule"] == "threshold", stage="decode"),
    FlagRule("--steps", "to the fixed-k and entropy-bound rules (the threshold rule's cap is --max-steps)",
             lambda a, c: c["rule"] in ("fixed-k", "entropy-bound"), stage="decode"),
    FlagRule(("--entropy-bound", "--stability", "--confidence"),
             "to the entropy-bound rule of the uniform-state models (DiffusionGemma)",
             lambda a, c: c["rule"] == "entropy-bound", stage="decode"),
    FlagRule(("--sampling-temperature", "--mask-policy"),
             "to the masked models (llada2_moe, llada_moe); a uniform-state model samples with the entropy-bound rule",
             lambda a, c: c["family"] != "diffusion_gemma", stage="decode"),
    FlagRule("--no-cache", "to llada2_moe's block-causal grid (the other families recompute nothing)",
             lambda a, c: c["family"] == "llada2_moe", stage="decode"),
    FlagRule(("--window", "--gate"), "to the flowblock schedule (--schedule flowblock)",
             lambda a, c: "flowblock" in _schedule_names(a)),
)
#: the flags of a masked model's token sampler, which do nothing under greedy decoding. Not on `dblock serve`,
#: whose requests may sample whatever the server's defaults
SAMPLING_RULES = (
    FlagRule(("--top-p", "--top-k"), "to a masked model sampling with --temperature T > 0 (greedy decoding takes "
             "the argmax)", lambda a, c: c["family"] != "diffusion_gemma" and c["sampling"] > 0, stage="decode"),
    FlagRule("--seed", "to what draws random numbers: a uniform-state model's noise, or a masked model sampling with "
             "--temperature T > 0 (greedy decoding draws nothing)",
             lambda a, c: c["family"] == "diffusion_gemma" or c["sampling"] > 0, stage="decode"),
)


def add_batch_size_arg(p, default=None, help_=None):
    p.add_argument("--batch-size", type=int_arg(1, MAX_BATCH), default=default,
                   help=help_ or "requests per forward (default: all)")


def add_executor_args(p):
    g = p.add_argument_group("executor")
    g.add_argument("--executor", default="reference", choices=["reference", "epoch"],
                   help="reference (dense, readable) or epoch (optimized: Expert Atlas + LSP + FreshLane)")
    g.add_argument("--epoch-config", default="epoch", choices=["epoch", "full_compute", "no_atlas", "no_lsp", "dense"],
                   help="epoch executor configuration (default epoch: all on)")
    g.add_argument("--refresh", type=int_arg(1, MAX_STEPS), default=None, help="LSP refresh period M_C (default 5)")
    g.add_argument("--atlas-alpha", type=float_arg(0.0, 1.0, lo_open=True), default=None,
                   help="Expert Atlas coverage floor alpha in (0, 1] (default 0.9)")
    g.add_argument("--atlas-q", type=float_arg(0.0, 1.0), default=None,
                   help="Expert Atlas covered-token quota q in [0, 1] (default 0.95)")
    g.add_argument("--update-every", type=int_arg(1, MAX_STEPS), default=None,
                   help="Expert Atlas rebuild period: a support is rebuilt on the first all-fresh (refresh) pass at "
                        "least this many passes after its last build (default 4)")
    g.add_argument("--atlas-m", type=int_arg(0, MAX_STEPS), default=None,
                   help="Expert Atlas extra candidates per token (default K)")
    g.add_argument("--atlas-B", type=int_arg(1, MAX_STEPS), default=None,
                   help="Expert Atlas initial support size (default min(E, 4K))")
    g.add_argument("--atlas-beta", type=float_arg(0.0), default=None,
                   help="Expert Atlas score weight beta >= 0 (default 1)")
    g.add_argument("--atlas-c", type=int_arg(0, MAX_STEPS), default=None,
                   help="Expert Atlas experts added per repair round (default K)")
    g.add_argument("--margin-refresh", type=bound_arg, default=None, metavar="DELTA",
                   help="epoch executor: margin-gated exact refresh (docs/algorithms.md §4.7): a request whose pass "
                        "served a cached row or routed within a restricted support is recomputed exactly "
                        "(full_compute) when its block's decision radius at the Epoch logits is <= DELTA, a bound "
                        "on the logit error of an approximate pass (0 never, inf always; default off). Not the "
                        "LSP period --refresh")
    g.add_argument("--lsp-drift", type=bound_arg, default=None, metavar="EPS",
                   help="epoch executor: LSP's drift bound (docs/algorithms.md §4.3): a stable decoded row is served "
                        "from the cache only while its MoE input has moved by at most EPS of its norm since its "
                        "entry was written, else it is computed fresh (0 serves only unmoved rows, inf is the age "
                        "bound alone; default off)")
    g.add_argument("--use-triton", action="store_true",
                   help="run the epoch executor's Triton kernels (interpreter on a machine without a GPU)")
    g.add_argument("--epoch-path", default=None, choices=["auto", "epoch", "dense"],
                   help="epoch executor: per block and pass, auto (default) takes the dense path where skipping "
                        "cannot pay (the cost rule of docs/algorithms.md §4.1); epoch or dense pin one path")
    g.add_argument("--path-profile", default=None, metavar="JSON",
                   help="epoch executor: a measured path model {moe_share, overhead_share} for the auto rule "
                        "(benchmarks/epoch_cpu.py measures one); default: the cost model's")
    # expert/sequence-parallel MoE on torch.distributed (dblock.optimized.ep)
    g.add_argument("--ep", type=int_arg(1, 4096), default=None,
                   help="expert-parallel ranks: launch with torchrun --nproc-per-node N -m dblock ... --ep N (gloo on "
                        "cpu, NCCL on cuda; default: the launcher's world size, or 1 process without torchrun; "
                        "--ep 1 runs the distributed code path in one process)")
    g.add_argument("--ep-dispatch", default="freshlane", choices=["freshlane", "dense"],
                   help="with --ep / torchrun: move only fresh rows (freshlane, default) or every row (dense, for "
                        "comparison); traces count both either way")
    add_flag_rules(p, *EXECUTOR_RULES)


def _epoch(a) -> bool:
    return getattr(a, "executor", "reference") == "epoch"


def _under_torchrun() -> bool:
    from dblock.ranks import under_torchrun
    return under_torchrun()


#: the executor flags that act in one mode only: the epoch executor, and within it its configurations
#: (dblock/optimized/plan.py `EpochConfig.named`: epoch = Atlas + LSP, no_atlas, no_lsp, full_compute = neither,
#: dense = the reference)
EXECUTOR_RULES = (
    FlagRule(("--epoch-config", "--refresh", "--atlas-alpha", "--atlas-q", "--update-every", "--atlas-m", "--atlas-B",
              "--atlas-beta", "--atlas-c", "--margin-refresh", "--lsp-drift", "--use-triton", "--epoch-path",
              "--path-profile", "--ep", "--ep-dispatch"),
             "with --executor epoch (the reference executor runs every expert on every row: it has no Expert Atlas, "
             "LSP, pass paths, Triton kernels or expert parallelism)", lambda a, c: _epoch(a)),
    FlagRule(("--use-triton", "--epoch-path", "--path-profile", "--ep"),
             "to an --epoch-config other than dense (dense is the reference executor)",
             lambda a, c: a.epoch_config != "dense"),
    FlagRule(("--atlas-alpha", "--atlas-q", "--update-every", "--atlas-m", "--atlas-B", "--atlas-beta", "--atlas-c"),
             "to the --epoch-config values with Expert Atlas (epoch, no_lsp)",
             lambda a, c: a.epoch_config in ("epoch", "no_lsp")),
    FlagRule(("--refresh", "--lsp-drift"), "to the --epoch-config values with LSP (epoch, no_atlas)",
             lambda a, c: a.epoch_config in ("epoch", "no_atlas")),
    FlagRule("--margin-refresh", "to the approximate --epoch-config values (epoch, no_atlas, no_lsp): full_compute "
             "and dense are exact", lambda a, c: a.epoch_config in ("epoch", "no_atlas", "no_lsp")),
    FlagRule("--path-profile", "to the auto pass path (--epoch-path auto, the default): a pinned path asks no model",
             lambda a, c: a.epoch_path in (None, "auto")),
    FlagRule("--ep-dispatch", "with --ep N or under torchrun (one process has nothing to dispatch)",
             lambda a, c: a.ep is not None or _under_torchrun()),
)


def show_progress(args=None) -> bool:
    """Progress bars on stderr: never with --json; `DBLOCK_PROGRESS=1` / `0` forces them on / off; otherwise only
    when stderr is a terminal (so a captured stderr holds nothing but the one-line error, should the command fail)."""
    if args is not None and getattr(args, "json", False):
        return False
    env = os.environ.get("DBLOCK_PROGRESS")
    return env == "1" or (env != "0" and sys.stderr.isatty())
