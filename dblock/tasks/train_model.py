"""The model and tokenizer of a `dblock train-tiny` run: the seeded init (`build_model`, `init_weights`), a second
stage's start from another model's weights (`init_from_model`), training-time fused attention, and the run's
tokenizer (the character tokenizer -- the exec task's own character vocabulary for `--task exec` -- or the code task's
byte-level BPE kept in the run folder)."""
from __future__ import annotations

import math

import torch

from dblock.tasks import CharTokenizer
from dblock.tasks.train_config import TrainConfig, is_code_task, is_exec_task, llada2_config


def init_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """GPT-2 style init, deterministic in `seed`: N(0, std) matrices and embeddings, output projections (attention
    `wo`, MLP/expert `down`) scaled by 1/sqrt(2 n_layers), norms 1, expert bias 0."""
    g = torch.Generator().manual_seed(seed)
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            s = std
            if name.endswith(("wo.weight", "down.weight", "w_down")):
                s = std / math.sqrt(2 * n_layers)
            p.copy_(torch.randn(p.shape, generator=g) * s)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias") and b is not None:
                b.zero_()


def build_model(cfg: TrainConfig, tok=None) -> torch.nn.Module:
    """The seeded model of a run; `tok` (the run's tokenizer) sets the vocabulary and special ids (default: the
    character tokenizer)."""
    if cfg.family == "diffusion_gemma":
        from dblock.tasks.train_uniform import build_gemma
        model = build_gemma(cfg, tok)
    else:
        from dblock.reference.llada import LladaModel
        model = LladaModel(llada2_config(cfg.size, cfg.block_size, tok))
        init_weights(model, cfg.seed)
    if cfg.fused_attention:
        set_fused_attention(model, True)
    return model


def set_fused_attention(model, on: bool) -> None:
    """Training-time attention through torch's fused `scaled_dot_product_attention` (the same function as the
    reference's explicit softmax, computed in another order): `fused` on every attention module that has it."""
    for mod in model.modules():
        if hasattr(mod, "fused"):
            mod.fused = bool(on)


def make_tokenizer(cfg: TrainConfig, run_dir: str, resume: bool):
    """The run's tokenizer: the character tokenizer, or for task `code` the byte-level BPE -- read back from the run
    folder on --resume, taken from --tokenizer (or the --init-from model's folder), else built from the corpus --
    and written into the run folder so that a resumed run uses the very same one."""
    if is_exec_task(cfg.task):
        from dblock.tasks.exec_task import exec_tokenizer
        tok = exec_tokenizer()
        tok.save(run_dir)
        return tok
    if not is_code_task(cfg.task):
        return CharTokenizer()
    from dblock.tasks.code_corpus import CodeTokenizer
    if resume:
        return CodeTokenizer.load(run_dir)
    source = cfg.tokenizer
    if source is None and cfg.init_from:
        from dblock.weights_path import resolve_model_path
        source = resolve_model_path(cfg.init_from)
    tok = CodeTokenizer.load(source) if source else CodeTokenizer.build(cfg.vocab_size)
    tok.save(run_dir)
    return tok


def init_from_model(model: torch.nn.Module, source: str, tok=None, first_layers: bool = False) -> None:
    """Copy the weights (and the expert bias) of the model at `source` into `model`; a ConfigError naming the
    first differing config field when the two are not the same architecture. Two differences are bridged: a run with
    a character tokenizer (`tok`, e.g. the exec task's) started from a byte-level BPE model (the bundled code
    models: every single byte is a token of theirs) takes the embedding and LM-head row of each of its characters
    from that character's BPE token, and of each special token from the same special there -- so what the source
    learned about characters carries over; and with `first_layers` (`--init-first-layers`) a run with fewer layers
    than the source takes the source's first layers (their attention types must match), its embedding, final norm
    and head -- a shallower model that starts from what a deeper one's lower layers learned."""
    from dblock.errors import ConfigError
    from dblock.weights import load
    src = load(source)
    a, b = src.config, model.config
    sd = src.state_dict()
    mapped = a.vocab_size != b.vocab_size and isinstance(tok, CharTokenizer) and a.vocab_size > 256
    if mapped:
        sd = _char_rows_from_bpe(sd, src, tok, source)
    if first_layers:
        n = b.num_hidden_layers
        if a.num_hidden_layers < n:
            raise ConfigError(f"--init-first-layers: {source} has {a.num_hidden_layers} layers, this run "
                              f"{n}; it takes the first layers of a source with at least as many")
        types_a, types_b = getattr(a, "layer_types", None), getattr(b, "layer_types", None)
        if types_b is not None and list(types_a or [])[:n] != list(types_b):
            raise ConfigError(f"--init-first-layers: the first {n} layer types of {source} are "
                              f"{list(types_a or [])[:n]}, this run's {list(types_b)}")
        sd = {k: v for k, v in sd.items() if not (k.startswith("layers.") and int(k.split(".")[1]) >= n)}
    for field in ("family",) + (() if mapped else ("vocab_size",)) + ("hidden_size",) + (
                  () if first_layers else ("num_hidden_layers",)) + ("num_experts", "num_experts_per_tok",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "moe_intermediate_size"):
        if getattr(a, field, None) != getattr(b, field, None):
            raise ConfigError(f"--init-from {source}: {field} is {getattr(a, field, None)!r} there, "
                              f"{getattr(b, field, None)!r} for this run (family and --size must match)")
    model.load_state_dict(sd)


def _char_rows_from_bpe(sd: dict, src, tok: CharTokenizer, source: str) -> dict:
    """`sd` with its embedding and LM-head rows re-indexed to `tok`'s ids (see `init_from_model`)."""
    from dblock.errors import ConfigError
    from dblock.tasks.code_corpus import CodeTokenizer
    from dblock.tasks.tokenizer import SPECIAL_TOKENS
    try:
        bpe = CodeTokenizer.load(src.source)
    except Exception as e:                     # noqa: BLE001 -- any unreadable tokenizer: one clear error
        raise ConfigError(f"--init-from {source}: its vocabulary ({src.config.vocab_size}) differs from this run's "
                          f"({tok.vocab_size}) and its tokenizer cannot map characters ({e})") from None
    ids = []
    for t in tok.vocab:
        got = bpe.hf.token_to_id(t) if t in SPECIAL_TOKENS else None
        if got is None:
            enc = bpe.encode(t)
            if len(enc) != 1:
                raise ConfigError(f"--init-from {source}: the character {t!r} is not one token of its tokenizer")
            got = enc[0]
        ids.append(got)
    out = dict(sd)
    for k in _VOCAB_ROWS:                      # llada2_moe: embedding and LM head; diffusion_gemma: the tied embedding
        if k in out:
            out[k] = out[k][ids].clone()
    return out


#: the state-dict tensors with one row per vocabulary entry, in either family
_VOCAB_ROWS = ("embed.weight", "lm_head.weight", "embed_tokens.weight")
