"""Prompts as token ids: text through the model folder's tokenizer (`encode_text`: the spelling of a special token
is ordinary text unless `"allow_special_tokens": true`), token ids as given, within the server's prompt limit
(`encode`); every failure a 400 naming the field (`prompt`, `prompt[i]`, `messages`, `stop`)."""
from __future__ import annotations

from typing import Any, Optional

from dblock.serving.protocol_base import APIError, Limits


OPT_IN = '"allow_special_tokens": true'


def encode(x: Any, param: str, limits: Limits, tokenizer, add_special_tokens: bool = True,
           allow_special: bool = False, control_ids=()) -> list:
    """A prompt (text, or token ids) -> token ids within the prompt limit, or `APIError` naming `param`.

    Text goes through `dblock.tasks.tokenizer.encode_prompt`: with `allow_special` False (the default) the spelling
    of a special token is ordinary text and no control token (a special added token, or one of `control_ids`) can
    come out; a character outside the vocabulary is a 400 naming it."""
    if isinstance(x, str):
        if tokenizer is None:
            raise APIError(400, f"{param}: this model folder has no tokenizer.json: send token ids (a list of "
                           "integers)", param, "no_tokenizer")
        if len(x) == 0:
            raise APIError(400, f"{param}: empty string", param, "invalid_value")
        if len(x) > 16 * limits.max_prompt_tokens:     # bound the tokenizer's work before counting tokens
            raise APIError(400, f"{param}: {len(x)} characters; at most {limits.max_prompt_tokens} tokens are "
                           "accepted (--max-prompt-tokens)", param, "limit_exceeded")
        ids = encode_text(tokenizer, x, param, allow_special, add_special_tokens=bool(add_special_tokens),
                          control_ids=control_ids)
    else:
        ids = list(x)
    if len(ids) == 0:
        raise APIError(400, f"{param}: empty: give at least one token", param, "invalid_value")
    if len(ids) > limits.max_prompt_tokens:
        raise APIError(400, f"{param}: {len(ids)} tokens exceeds this server's limit of {limits.max_prompt_tokens} "
                       "(--max-prompt-tokens)", param, "limit_exceeded")
    return ids


def encode_text(tokenizer, text: str, param: str, allow_special: bool, *, add_special_tokens: bool = True,
                control_ids=(), name: Optional[str] = None) -> list:
    """`encode_prompt` with its `PromptError` as a 400 naming `param` ("{param}: cannot be tokenized: ..."); `name`
    (default `param`) is how the text is named inside the message."""
    from dblock.tasks.tokenizer import PromptError, encode_prompt
    name = name or param
    try:
        return encode_prompt(tokenizer, text, bool(allow_special), add_special_tokens=add_special_tokens,
                             control_ids=control_ids, name=name, opt_in=OPT_IN)
    except PromptError as e:
        msg = str(e)
        detail = msg[len(name) + 2:] if msg.startswith(name + ": ") else msg
        where = "" if name == param else f"{name}: "
        raise APIError(400, f"{param}: cannot be tokenized: {where}{detail}", param, "invalid_value") from None
    except Exception as e:                              # a tokenizer failure on odd text: still the request's 400
        detail = (str(e).splitlines() or [""])[0][:200]
        raise APIError(400, f"{param}: cannot be tokenized ({type(e).__name__}: {detail})", param,
                       "invalid_value") from None
