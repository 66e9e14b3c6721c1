"""The decoding flags of every command, parsed: a validated `DecodeConfig` and a `ScheduleSpec`, and what must fit
the model, checked from its config.json before the weights are read.

Every refusal names its flag: `--temperature` resolved per family (one number for the masked models, `t_max,t_min`
for DiffusionGemma), text `--stop` sequences encoded with the model's tokenizer, stop ids inside the vocabulary
(`check_stops`), and `check_fits`: a block larger than the model's positions, a prompt whose prompt +
--max-new-tokens needs more positions than max_position_embeddings (the serving engine's rule, `positions_needed`),
a token id outside the vocabulary; `check_seed_span` keeps every request's seed in [0, 2**63-1]. Imports nothing
heavy: the model, torch and the schedules are imported inside the functions, when a command runs.
"""
from __future__ import annotations

import argparse
import os

from dblock.cli_args import (_VALUE_MARK, MAX_SEED, TEMPERATURE_MIN, _show, check_flag_rules, temperature_flag_arg,
                             token_ids_arg)
from dblock.prompts import load_tokenizer


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
    steps = args.steps
    if steps is None and gemma and getattr(args, "model", None):
        from dblock.tasks.card import decoding_of           # the model card's default N (a uniform-state model)
        steps = decoding_of(args.model).get("steps")
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
    # the flags of one rule, sampler or family given where they would do nothing (dblock.cli_args.DECODE_RULES)
    check_flag_rules(args, "decode", family=family, rule=rule, sampling=sampling_t)
    min_tokens = getattr(args, "min_tokens", 0) or 0
    if min_tokens > args.max_new_tokens:
        raise ConfigError(f"--min-tokens {min_tokens}: at most --max-new-tokens {args.max_new_tokens}")
    n = getattr(args, "samples", None) or 1
    if n > 1:
        check_seed_span(args.seed, n, "--seed")
    return DecodeConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size, rule=rule,
                        threshold=args.threshold, max_steps=args.max_steps, steps=steps,
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


def positions_needed(prompt_len: int, max_new_tokens: int, block: int, family: str) -> int:
    """Positions a request may ever occupy (`dblock.decoding.params.footprint`, the serving engine's admission rule)."""
    from dblock.decoding.params import footprint
    return footprint(prompt_len, max_new_tokens, block, family)


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
