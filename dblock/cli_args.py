"""Option groups and helpers every `dblock` command shares: `--model`, the decoding flags, the executor flags, and
the helpers that turn parsed arguments into a decode config, a loaded model and a forward.

`dblock.cli` builds the command tree; each room's cli module (`dblock/<room>/cli.py`)
imports its option groups from here, never from `dblock.cli`, so the tree has no import cycle. Nothing heavy at
import (argparse, math, os and sys only): `dblock --help` and `dblock <command> --help` import no torch. Model,
torch and executor imports happen inside the helpers, when a command runs.

Bad input gets one clear error naming the culprit, before anything is allocated or loaded where possible:

  * every numeric flag has an argparse `type` with its allowed range (`int_arg`, `float_arg`, `seed_arg`,
    `temperature_arg`, `seeds_arg`); a value out of range, NaN, inf or of the wrong type stops the parse with one
    line naming the flag, the value and the range (`ArgumentParser.error` prints `dblock: error: ...`, exit 2);
  * what depends on the model is checked against its config.json before the weights are read
    (`model_config`, `check_fits`): a block larger than the model's positions, a prompt whose prompt +
    --max-new-tokens needs more positions than max_position_embeddings (the serving engine's rule,
    `positions_needed`), a token id outside the vocabulary, `--device cuda` on a torch without CUDA;
  * text prompts go through `dblock.tasks.tokenizer.encode_prompt`: the literal spelling of a special token
    (`<eos>`, `<mask>`, ...) is plain text unless `--allow-special-tokens` is given, and a character the vocabulary
    cannot encode is named with its position;
  * output paths are checked before any work (`check_out_dir`, `check_out_file`).

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
#: characters of a text prompt per position of the model: longer text is refused before it is tokenized (the
#: serving API bounds its prompts the same way, 16 characters per token of its limit)
CHARS_PER_POSITION = 16


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


#: the types' messages start with it, so that `ArgumentParser.error` can put the flag in front of the value
_VALUE_MARK = "= "


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


def add_decode_args(p):
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


# ---------------------------------------------------------------------------------------------------------------
# parsed arguments -> decode config, schedule, model config (checked before the weights are read)
# ---------------------------------------------------------------------------------------------------------------

def decode_config(args, family: str, tokenizer=None):
    """Parsed decoding flags -> a validated `DecodeConfig` for a model of `family`; every refusal names its flag.

    `--temperature` is resolved per family: one number is the masked families' sampling temperature (the same as
    `--sampling-temperature`), `t_max,t_min` DiffusionGemma's entropy-bound schedule; the other combination is
    refused, as are the masked sampler's flags (--sampling-temperature, --top-p, --top-k, --mask-policy) on
    DiffusionGemma. `tokenizer` (a loaded tokenizer, or the model folder / loaded model to read tokenizer.json from,
    only when needed) encodes text `--stop` sequences; `--n` (samples per prompt) is read where the command has it
    (`generate`: `args.samples`)."""
    from dblock.decoding.params import DecodeConfig
    from dblock.errors import ConfigError
    gemma = family == "diffusion_gemma"
    temp = getattr(args, "temperature", None)
    if isinstance(temp, str):                  # a parser built without `temperature_flag_arg`
        try:
            temp = temperature_flag_arg(temp)
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"--temperature {str(e).removeprefix(_VALUE_MARK)}") from None
    if isinstance(temp, (list, tuple)) and len(temp) == 1:
        temp = float(temp[0])
    st = getattr(args, "sampling_temperature", None)
    top_p, top_k = getattr(args, "top_p", None), getattr(args, "top_k", None)
    mask_policy = getattr(args, "mask_policy", None) or "exclude"
    if gemma:
        if isinstance(temp, (int, float)):
            raise ConfigError(f"--temperature {temp:g}: one number is the masked models' sampling temperature; "
                              f"{family} samples with the entropy-bound schedule: give t_max,t_min (e.g. 0.8,0.4; "
                              f"{max(temp, TEMPERATURE_MIN):g},{max(temp, TEMPERATURE_MIN):g} for a constant "
                              "temperature)")
        for flag, v, neutral in (("--sampling-temperature", st, 0.0), ("--top-p", top_p, 1.0),
                                 ("--top-k", top_k, 0), ("--mask-policy", mask_policy, "exclude")):
            if v is not None and v != neutral:
                raise ConfigError(f"{flag} {v}: a masked-model option; {family} is uniform-state and samples with "
                                  "the entropy-bound rule (--temperature t_max,t_min, --seed)")
        schedule_t = (0.8, 0.4) if temp is None else tuple(temp)
        sampling_t = 0.0
    else:
        if isinstance(temp, (list, tuple)):
            raise ConfigError(f"--temperature {','.join(f'{t:g}' for t in temp)}: t_max,t_min is DiffusionGemma's "
                              f"entropy-bound schedule; {family} is masked: give one number T, the sampling "
                              "temperature (0 = greedy)")
        if temp is not None and st is not None and float(temp) != float(st):
            raise ConfigError(f"--temperature {temp:g} and --sampling-temperature {st:g}: the same setting on a "
                              "masked model; give one of them")
        schedule_t = (0.8, 0.4)
        sampling_t = float(temp if temp is not None else st if st is not None else 0.0)
    rule = args.rule or ("entropy-bound" if gemma else "threshold")
    if gemma and rule != "entropy-bound":
        raise ConfigError(f"--rule {rule}: diffusion_gemma is uniform-state and decodes with entropy-bound")
    if not gemma and rule == "entropy-bound":
        raise ConfigError(f"--rule {rule}: the uniform-state rule; {family} is masked diffusion (threshold, fixed-k)")
    if args.no_cache and family != "llada2_moe":
        raise ConfigError(f"--no-cache applies to llada2_moe's block-causal grid, not {family}")
    threshold_steps = getattr(args, "threshold_steps", None)
    if threshold_steps is None and rule == "threshold" and getattr(args, "model", None):
        from dblock.tasks.card import decoding_of           # the model card's default (the bundled code-masked)
        threshold_steps = decoding_of(args.model).get("threshold_steps")
    elif threshold_steps == 0:                              # explicitly off, whatever the card says
        threshold_steps = None
    if threshold_steps is not None and rule != "threshold":
        raise ConfigError(f"--threshold-steps {threshold_steps}: the threshold rule's LLaDA2.0 quota; the rule here is "
                          f"{rule}")
    if not gemma and temp is None and st is None:       # (an explicit --temperature 0 keeps greedy on purpose)
        for flag, v, neutral in (("--top-p", top_p, 1.0), ("--top-k", top_k, 0)):
            if v is not None and v != neutral:
                raise ConfigError(f"{flag} {v}: filters the sampler, and without --temperature decoding is greedy "
                                  "(argmax), so it would do nothing: give --temperature T > 0 too")
    min_tokens = getattr(args, "min_tokens", 0) or 0
    if min_tokens > args.max_new_tokens:
        raise ConfigError(f"--min-tokens {min_tokens}: at most --max-new-tokens {args.max_new_tokens}")
    n = getattr(args, "samples", None) or 1
    if n > 1:
        check_seed_span(args.seed, n, "--seed")
    return DecodeConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size, rule=rule,
                        threshold=args.threshold, max_steps=args.max_steps, steps=args.steps,
                        no_cache=args.no_cache, seed=args.seed, entropy_bound=args.entropy_bound,
                        temperature=schedule_t, stability=args.stability, confidence=args.confidence,
                        threshold_inclusive=bool(getattr(args, "threshold_inclusive", False)),
                        threshold_steps=threshold_steps, mask_policy=mask_policy, sampling_temperature=sampling_t,
                        top_p=1.0 if top_p is None else top_p, top_k=0 if top_k is None else top_k,
                        stop_token_ids=tuple(getattr(args, "stop_token_ids", None) or ()),
                        stop=stop_sequences_arg(getattr(args, "stop", None) or (), tokenizer),
                        min_tokens=min_tokens, ignore_eos=bool(getattr(args, "ignore_eos", False)),
                        n=n).validate()


def stop_sequences_arg(values, tokenizer=None) -> tuple:
    """`--stop` values -> token-id sequences. A value of comma-separated integers (`5` or `12,7`), or `ids:...`, is
    token ids; anything else, or `text:...`, is text, encoded by the model's tokenizer without special tokens (the
    spelling of a special token stays plain text). `tokenizer`: a loaded tokenizer, or a model folder / loaded
    model whose tokenizer.json is read when a text value needs it."""
    import re

    from dblock.errors import ConfigError
    ids_re = re.compile(r"\s*\d+(\s*,\s*\d+)*\s*")
    out, tok = [], tokenizer
    for v in values:
        v = str(v)
        if v.startswith("ids:") or (not v.startswith("text:") and ids_re.fullmatch(v)):
            try:
                out.append(tuple(token_ids_arg(v.removeprefix("ids:"))))
            except argparse.ArgumentTypeError as e:
                raise ConfigError(f"--stop {str(e).removeprefix(_VALUE_MARK)}") from None
            continue
        text = v.removeprefix("text:")
        if tok is not None and (isinstance(tok, (str, os.PathLike)) or hasattr(tok, "source")):
            tok = load_tokenizer(tok)
        if tok is None:
            raise ConfigError(f"--stop {_show(text)!r}: a text stop sequence needs the model's tokenizer.json; give "
                              "token ids (--stop ID,ID)")
        from dblock.tasks.tokenizer import encode_prompt
        out.append(tuple(encode_prompt(tok, text, False, add_special_tokens=False, name=f"--stop {_show(text)!r}")))
    return tuple(out)


def check_stops(cfg, dec) -> None:
    """Stop token ids (--stop-token-ids, --stop) inside the model's vocabulary, before the weights are read."""
    from dblock.errors import ConfigError
    V = cfg.vocab_size
    for flag, ids in [("--stop-token-ids", dec.stop_token_ids)] + [("--stop", s) for s in dec.stop]:
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
            raise ConfigError(f"{flag}: token id {_show(bad)} outside the vocabulary 0..{V - 1}")


def schedule_from_args(args):
    """`--schedule` (with --window, --gate) as a `ScheduleSpec`; an unknown name is refused naming the flag."""
    from dblock.decoding.schedules import schedule_spec
    from dblock.errors import ConfigError
    try:
        return schedule_spec(args.schedule, args.window, args.gate)
    except ValueError as e:
        raise ConfigError(f"--schedule {_show(args.schedule)}: {e}") from None


def check_device(device: str) -> str:
    """`--device` as given, after checking this torch can use it: cpu, cuda or cuda:N."""
    import torch
    from dblock.errors import ConfigError
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"--device {_show(device)!r}: not a device; give cpu, cuda or cuda:N") from None
    if d.type == "cpu":
        return device
    if d.type != "cuda":
        raise ConfigError(f"--device {_show(device)}: allowed cpu, cuda, cuda:N")
    if torch.version.cuda is None:
        raise ConfigError(f"--device {device}: CUDA is not available in this torch build (torch {torch.__version__} "
                          "is CPU-only); use --device cpu or install a CUDA build of torch")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device is visible (torch {torch.__version__}, CUDA "
                          f"{torch.version.cuda}; check the driver and CUDA_VISIBLE_DEVICES); use --device cpu")
    n = torch.cuda.device_count()
    if d.index is not None and d.index >= n:
        raise ConfigError(f"--device {device}: this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}")
    return device


def model_config(args):
    """(folder, config) of `--model`, read from config.json alone (no weights), after checking `--device`."""
    from dblock.config import load_config
    from dblock.weights import resolve_model_path
    from dblock.errors import ConfigError
    if not str(args.model or "").strip():
        raise ConfigError("--model: empty; give a model folder or a bundled name (tiny-masked, tiny-uniform)")
    if getattr(args, "device", None) is not None:
        check_device(args.device)
    folder = resolve_model_path(args.model)
    return folder, load_config(folder)


def positions_needed(prompt_len: int, max_new_tokens: int, block: int, family: str) -> int:
    """Positions a request may ever occupy (`dblock.decoding.params.footprint`, the serving engine's admission rule)."""
    from dblock.decoding.params import footprint
    return footprint(prompt_len, max_new_tokens, block, family)


def control_ids(cfg) -> set:
    """The model's control token ids (`dblock.tasks.tokenizer.control_ids`)."""
    from dblock.tasks.tokenizer import control_ids as ids
    return ids(cfg)


def check_fits(cfg, dec, spec, prompts) -> None:
    """Refuse, with the numbers, what cannot run on this model: a block larger than its positions, a prompt token
    outside the vocabulary, a prompt whose prompt + --max-new-tokens needs more than max_position_embeddings, a stop
    token id outside the vocabulary (`check_stops`).
    `prompts`: (label, token ids) pairs, the label naming where the prompt came from (`--prompt [0]`)."""
    from dblock.errors import ConfigError
    check_stops(cfg, dec)
    family = cfg.family
    width = getattr(spec, "width", 1) or 1
    block = (dec.block_size or cfg.block_size) * width
    max_pos = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
    V = cfg.vocab_size
    if max_pos is not None and block > max_pos:
        flag = (f"--block-size {dec.block_size}" if dec.block_size else f"the model's block_size {cfg.block_size}")
        w = f" x {width} (--schedule {spec.name})" if width > 1 else ""
        raise ConfigError(f"{flag}{w}: a block of {block} positions exceeds the model's {max_pos} positions "
                          f"(max_position_embeddings); give --block-size 1..{max_pos // width}")
    M = dec.max_new_tokens
    for label, ids in prompts:
        if len(ids) == 0:
            raise ConfigError(f"{label}: empty prompt: give at least one token")
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
            raise ConfigError(f"{label}: token id {_show(bad)} outside the vocabulary 0..{V - 1}")
        if max_pos is None:
            continue
        need = positions_needed(len(ids), M, block, family)
        if need > max_pos:
            room = ((max_pos // block) * block - len(ids) if family == "llada2_moe"
                    else ((max_pos - len(ids)) // block) * block)
            fix = (f"give --max-new-tokens <= {room}" if room >= 1 else
                   f"the prompt alone leaves no room for one {block}-position block: shorten it")
            n = len(ids)
            raise ConfigError(f"{label}: {n} prompt token{'s' if n != 1 else ''} + --max-new-tokens {M} need "
                              f"{need} positions ({block}-position blocks); the model has {max_pos} "
                              f"(max_position_embeddings): {fix}")


def check_seed_span(seed: int, count: int, flag: str = "--seed") -> None:
    """Requests get seeds seed, seed+1, ..., seed+count-1: all of them must stay in [0, 2**63-1]."""
    from dblock.errors import ConfigError
    if count > 0 and seed + count - 1 > MAX_SEED:
        raise ConfigError(f"{flag} {seed}: the {count} requests get seeds up to {seed + count - 1}, beyond 2**63-1; "
                          f"give a seed <= {MAX_SEED - count + 1}")


def load_model(args):
    import dblock
    check_device(args.device)
    dtype = args.dtype or ("float32" if args.device == "cpu" else None)
    device = args.device
    if device == "cuda" and "LOCAL_RANK" in os.environ:      # torchrun: one GPU per process
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    progress = True if getattr(args, "progress", False) else None     # None: a bar on a terminal for big loads
    if not is_rank0():
        progress = False
    return dblock.load(args.model, dtype=dtype, device=device, progress=progress)


def under_torchrun() -> bool:
    """Started by torchrun: every rank runs the command, rank 0 prints and writes files."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def make_forward(model, args):
    """The executor chosen on the command line, over the loaded model's weights."""
    from dblock.decoding.generate import reference_forward
    ep = getattr(args, "ep", None)
    if ep is not None and (getattr(args, "executor", "reference") == "reference" or args.epoch_config == "dense"):
        raise ValueError(f"--ep {ep}: expert parallelism runs the epoch executor; add --executor epoch (and an "
                         "--epoch-config other than dense)")
    if getattr(args, "executor", "reference") == "reference":
        return reference_forward(model)
    from dblock.optimized.executor import epoch_forward
    dispatcher = None
    if (ep is not None or under_torchrun()) and args.epoch_config != "dense":
        from dblock.optimized.ep import dispatcher_from_cli
        dispatcher = dispatcher_from_cli(model, ep, args.ep_dispatch, str(model.embed.weight.device))
    return epoch_forward(model, args.epoch_config, refresh=args.refresh, atlas_alpha=args.atlas_alpha,
                         atlas_q=args.atlas_q, update_every=args.update_every, use_triton=args.use_triton,
                         dispatcher=dispatcher, atlas_m=args.atlas_m, atlas_B=args.atlas_B,
                         atlas_beta=args.atlas_beta, atlas_c=args.atlas_c, path=args.epoch_path,
                         path_model=_path_model(args.path_profile))


def _path_model(path):
    """--path-profile FILE -> PathModel (a missing or malformed file is one error naming it)."""
    if path is None:
        return None
    from dblock.optimized.plan import PathModel
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--path-profile {path}: no such file")
    try:
        return PathModel.load(path)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--path-profile {path}: {e}") from None


# ---------------------------------------------------------------------------------------------------------------
# tokenizer and prompts
# ---------------------------------------------------------------------------------------------------------------

def load_tokenizer(model_or_folder):
    """The model folder's tokenizer.json through the `tokenizers` package, or None when the folder has none.
    `model_or_folder`: a loaded model (its `.source` folder) or a folder. A file that does not parse is a
    `ConfigError` naming it."""
    folder = model_or_folder if isinstance(model_or_folder, (str, os.PathLike)) else \
        getattr(model_or_folder, "source", "")
    path = os.path.join(folder or "", "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from dblock.tasks.tokenizer import read_tokenizer
    return read_tokenizer(path)


def encode_texts(tok, texts, cfg, labels, allow_special: bool = False, where: str = "") -> list:
    """Text prompts -> token ids through `dblock.tasks.tokenizer.encode_prompt`: at most CHARS_PER_POSITION
    characters per model position, literal special tokens as plain text unless `allow_special`, the model's control
    ids refused. `labels[i]` names prompt i in errors; `where` is the model folder (for the no-tokenizer error)."""
    from dblock.errors import ConfigError
    from dblock.tasks.tokenizer import encode_prompt
    texts = list(texts)
    if texts and tok is None:
        raise ConfigError(f"{labels[0]}: a text prompt needs a tokenizer.json in the model folder {where}; give "
                          "token ids instead")
    max_pos = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    max_chars = CHARS_PER_POSITION * max_pos if max_pos else None
    ctrl = control_ids(cfg)
    return [encode_prompt(tok, t, allow_special, control_ids=ctrl, max_chars=max_chars, name=label,
                          opt_in="--allow-special-tokens") for t, label in zip(texts, labels)]


def parse_ids(s: str, flag: str = "--prompt-ids") -> list:
    try:
        ids = [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"{flag} {_show(s)!r}: give comma-separated integers, e.g. 5,6,7") from None
    if not ids:
        raise ValueError(f"{flag} {s!r}: empty; give comma-separated integers, e.g. 5,6,7")
    return ids


# ---------------------------------------------------------------------------------------------------------------
# output paths
# ---------------------------------------------------------------------------------------------------------------

def check_out_dir(path: str, flag: str = "--out") -> None:
    """An output folder: refused when it exists as something else, or when its parent is not a writable folder."""
    from dblock.errors import ConfigError
    if not path:
        raise ConfigError(f"{flag}: empty path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: exists and is not a folder")
    if os.path.isdir(path):
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{flag} {path}: the folder is not writable")
        return
    parent = _existing_parent(path)
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: cannot create it in {parent} (not writable)")


def check_out_file(path: str, flag: str = "--out") -> None:
    """An output file: refused when it is a folder, or when its folder does not exist or is not writable."""
    from dblock.errors import ConfigError
    if not path:
        raise ConfigError(f"{flag}: empty path")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: is a folder; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is not a folder" if os.path.exists(parent) else "does not exist"
        raise ConfigError(f"{flag} {path}: {parent} {what}")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path}: the file is not writable")
    if not os.path.exists(path) and not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: the folder {parent} is not writable")


def _existing_parent(path: str) -> str:
    p = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(p):
        nxt = os.path.dirname(p)
        if nxt == p:
            break
        p = nxt
    return p


def prepare_triton(args) -> None:
    """`--use-triton` on a machine without CUDA: put Triton in interpreter mode before anything imports triton.

    Triton fixes interpreter vs compiled mode when `@triton.jit` decorates a function, and torch may import triton
    on its own once a model is built, so the mode has to be chosen at the start of the process (see
    `dblock.kernels`). This sets TRITON_INTERPRET=1 only when the user did not set the variable, triton is not
    imported yet and no CUDA device is visible; otherwise it leaves the process as it is.
    """
    if not getattr(args, "use_triton", False) or "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    import torch
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
