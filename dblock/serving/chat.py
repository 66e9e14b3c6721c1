"""Chat templates: OpenAI `messages` -> the prompt text a model was trained on, as transformers and vLLM do it.

Where the template comes from (first found wins):
  1. `dblock serve --chat-template PATH_OR_STRING`: a file, or the template text itself (vLLM's rule: text holding
     none of `{`, `}` or a newline is a path, and a path that cannot be read is an error);
  2. `chat_template.jinja` in the model folder (what transformers >= 4.43 writes);
  3. the `chat_template` field of the folder's `tokenizer_config.json` (a string, or a list of named templates,
     of which "default" is used).
No template: `/v1/chat/completions` answers 400 (`load_chat_template` returns None).

Rendering follows `transformers.PreTrainedTokenizerBase.apply_chat_template`: a Jinja2
`ImmutableSandboxedEnvironment` (templates read data, never change it or reach Python internals) with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` block (rendered as its body),
a `tojson` filter that keeps non-ASCII text, and the globals `raise_exception(message)` (the template refuses a
conversation: 400 naming `messages`) and `strftime_now(format)`. Variables: `messages` (list of dicts with `role`,
`content` and any other fields the client sent), `add_generation_prompt`, the special tokens named in
`tokenizer_config.json` (`bos_token`, `eos_token`, `pad_token`, ...; "" when absent), `tools` and `documents`
(None), and the request's `chat_template_kwargs`. The rendered text is tokenized without adding special tokens
(the template writes them), as vLLM does for chat.

Special tokens in messages: the template's own control tokens (the `<eos>` it writes after an assistant turn, a
BOS, role markers) are real control tokens, since the rendered text is tokenized with special tokens recognised.
Message text is the client's, though, and must not smuggle control tokens in: unless the request opts in with
`"allow_special_tokens": true`, the server (`serving_chat.py`) refuses, with a 400 naming the field
(`messages[0].content`) and the spelling, any message string or `chat_template_kwargs` string that holds the spelling
of one of the tokenizer's special tokens (`find_special_text`). vLLM renders and tokenizes the same way, without
this check; refusing such text (rather than re-encoding it as plain characters) keeps the rendered prompt exactly
what the template produced, whatever the tokenizer.

The bundled tiny models (`dblock/checkpoints/*/chat_template.jinja`) were trained on bare prompts such as
`123+45=`: their template renders a single user message as exactly its content, so chat and completions agree.
"""
from __future__ import annotations

import codecs
import json
import os
import re
from datetime import datetime
from typing import Any, Optional

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
_JINJA_CHARS = "{}\n"


class ChatTemplateError(ValueError):
    """The template refused the conversation (`raise_exception`) or failed while rendering it."""


def resolve_template_arg(value: str) -> str:
    """`--chat-template PATH_OR_STRING` -> template text (vLLM's `load_chat_template` rule)."""
    if os.path.isfile(value):
        from dblock.input_files import read_text
        return read_text(value, "--chat-template")      # bounded, UTF-8: errors name the flag and the file
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"--chat-template {value!r}: looks like a file path, but cannot be read "
                             f"({e.strerror or e})") from None
    return codecs.decode(value, "unicode_escape")          # "\n" typed on a command line becomes a newline


def _token_text(v: Any) -> str:
    if isinstance(v, dict):                                  # AddedToken form: {"content": "<s>", ...}
        v = v.get("content")
    return v if isinstance(v, str) else ""


def read_tokenizer_config(model_dir: Optional[str]) -> dict:
    path = os.path.join(model_dir or "", "tokenizer_config.json")
    if not model_dir or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read ({e})") from None
    return data if isinstance(data, dict) else {}


def find_template(model_dir: Optional[str], tokenizer_config: Optional[dict] = None) -> Optional[str]:
    """The model folder's template text (chat_template.jinja, else tokenizer_config.json), or None."""
    if model_dir:
        path = os.path.join(model_dir, TEMPLATE_FILE)
        if os.path.isfile(path):
            from dblock.input_files import read_text
            return read_text(path)
    t = (tokenizer_config if tokenizer_config is not None else read_tokenizer_config(model_dir)).get("chat_template")
    if isinstance(t, list):                                  # [{"name": "default", "template": "..."}, ...]
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default")
    return t if isinstance(t, str) and t else None


def _environment():
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): rendered as its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template and the special tokens it may name."""

    def __init__(self, source: str, special_tokens: Optional[dict] = None, origin: str = "chat template"):
        from jinja2.exceptions import TemplateSyntaxError
        self.source, self.origin = source, origin
        self.special_tokens = {k: _token_text((special_tokens or {}).get(k)) for k in SPECIAL_TOKEN_KEYS}
        self._env = _environment()
        try:
            self._env.parse(source)          # syntax only: compiling (and jinja's constant folding, which can build
        except TemplateSyntaxError as e:     # a gigabyte string from '{{ "x" * 10**9 }}') waits for the first render
            raise ValueError(f"{origin}: not a valid Jinja template (line {e.lineno}: {e.message})") from None
        self._compiled = None

    @property
    def template(self):
        """The compiled template (compiled on first use: in the server that is inside a bounded render worker)."""
        if self._compiled is None:
            self._compiled = self._env.from_string(self.source)
        return self._compiled

    def render(self, messages: list, add_generation_prompt: bool = True, continue_final_message: bool = False,
               kwargs: Optional[dict] = None, max_chars: Optional[int] = None) -> str:
        """The prompt text of `messages` (dicts). `continue_final_message`: cut right after the last message's
        content so the model continues it (vLLM / transformers semantics; no generation prompt then).
        `max_chars`: stop as soon as the template has written more (a ChatTemplateError); the server renders
        through `render_worker.BoundedRenderer`, which adds a time limit."""
        from jinja2.exceptions import TemplateError
        vars_ = {"tools": None, "documents": None, **(kwargs or {}), **self.special_tokens,
                 "messages": messages, "add_generation_prompt": add_generation_prompt and not continue_final_message}
        try:
            if max_chars is None:
                text = self.template.render(**vars_)
            else:
                parts, n = [], 0
                for piece in self.template.generate(**vars_):
                    n += len(piece)
                    if n > max_chars:
                        raise ChatTemplateError(f"the template wrote more than {max_chars} characters (the server's "
                                                "limit, --template-max-chars): the render was stopped")
                    parts.append(piece)
                text = "".join(parts)
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(str(e) or type(e).__name__) from None
        except Exception as e:                                # a template bug: still the request's 400, not a 500
            raise ChatTemplateError(f"{type(e).__name__}: {e}") from None
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or not final.strip():
                raise ChatTemplateError("continue_final_message needs a final message with text content")
            at = text.rfind(final.strip())
            if at < 0:
                raise ChatTemplateError("continue_final_message: the final message's content does not appear in "
                                        "the rendered prompt")
            text = text[: at + len(final.strip())]
        return text


def special_text_pattern(spellings) -> Optional["re.Pattern"]:
    """One regex matching any of the special-token spellings (longest first), or None when there are none."""
    texts = sorted({t for t in spellings if isinstance(t, str) and t}, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in texts)) if texts else None


def find_special_text(value: Any, pattern, path: str) -> Optional[tuple]:
    """The first special-token spelling in the strings of `value` (a message dict, its lists and dicts, depth-first
    in order) as (path of the string, e.g. `messages[0].content`, position in it, the spelling), or None."""
    if isinstance(value, str):
        m = pattern.search(value)
        return (path, m.start(), m.group()) if m else None
    if isinstance(value, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for p, v in items:
        hit = find_special_text(v, pattern, p)
        if hit is not None:
            return hit
    return None


def load_chat_template(model_dir: Optional[str], override: Optional[str] = None) -> Optional[ChatTemplate]:
    """The template to serve `model_dir` with (`override`: the --chat-template value), or None when there is none."""
    tc = read_tokenizer_config(model_dir)
    if override:
        source, origin = resolve_template_arg(override), "--chat-template"
    else:
        source = find_template(model_dir, tc)
        origin = os.path.join(model_dir or "", TEMPLATE_FILE if model_dir and os.path.isfile(
            os.path.join(model_dir, TEMPLATE_FILE)) else "tokenizer_config.json")
    if source is None:
        return None
    return ChatTemplate(source, tc, origin)
