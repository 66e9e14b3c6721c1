"""Request and response bodies of the OpenAI-compatible server, as pydantic models; every 4xx names its field.
This module is their index: it documents every field and re-exports the models from one module per endpoint.

Requests are validated strictly (no "8" for 8, no true for 1). Every field a request may carry is listed below: a
field this server does not honour is refused by name with a 400 (`logit_bias`, the legacy `functions` /
`function_call`, ... : `NOT_HONOURED`, each with its reason; any other unknown field: "not a field this server
accepts", with the accepted ones), never silently ignored. A failed validation is a 400 whose message starts with the offending parameter
(`max_tokens: must be an integer >= 1, got 0`, `stream_options.include_usage: ...`, `messages[0].role: ...`).

`/v1/completions` (`CompletionRequest`)
  prompt        string (encoded by the model folder's tokenizer.json), a list of token ids, or a list of either
                (several prompts = several independent requests in one call, one choice each; at most `max_prompts`)
  max_tokens    integer >= 1 (default: the server's --max-new-tokens), at most `max_tokens_limit`
  seed          integer in [0, 2^63) or null (default: the server's --seed); maps to the request's noise seed
  stream        bool: server-sent events, one per committed block, then a final chunk and `data: [DONE]`
  stream_options {"include_usage": bool}
  model         optional; when given it must name the served model (else 404)
  add_special_tokens  bool (default true), as vLLM
  allow_special_tokens  bool (default false; a dblock extension): see "Special tokens" below
  n             integer >= 1 (default 1), at most `max_prompts`: n choices per prompt, sample j with seed + j
                (choice index prompt * n + j)
  best_of       only 1;  echo only false;  logprobs only null/0;  suffix only null
`/v1/chat/completions` (`ChatCompletionRequest`)
  messages      non-empty list of {"role", "content": string | [{"type": "text", "text"}] | null, ...}; rendered
                by the chat template (`chat.py`) with the generation prompt
  max_completion_tokens | max_tokens, seed, stream, stream_options, model, n, stop: as above
  add_generation_prompt (default true), continue_final_message (default false), chat_template_kwargs (object),
  add_special_tokens (default false), allow_special_tokens (default false); logprobs only false, top_logprobs
  only null/0, tools only null/[], tool_choice only null/"none"/"auto", response_format only null/{"type":
  "text"}; a per-request chat_template is refused (start the server with --chat-template)
Sampling and stop fields of both (numbers must be finite: NaN and Infinity are refused), applied per request as a
`dblock.decoding.params.SamplingParams` (docs/algorithms.md §2.4, §2.6; the mapping is in `serving_engine.py`); an
absent field takes the server's default (`dblock serve` decoding flags: greedy, no stops, unless set there):
  temperature   0 (greedy argmax, dblock's default; OpenAI's default of 1 is not assumed) or a number in
                [1e-4, 1e4]: masked models sample from softmax(z / T) after top_k and top_p
  top_p         number in (0, 1];  top_k  integer: -1 or 0 = off, or >= 1
                (DiffusionGemma samples with its own entropy-bound schedule: temperature/top_p/top_k other than
                0/1/off get 400 naming the field)
  stop          string or list of at most `MAX_STOPS` non-empty strings: the returned text ends before the first
                one (excluded, as OpenAI); also tokenized, so decoding stops there
  stop_token_ids  list of token ids that end generation like EOS (vLLM's)
  min_tokens    integer >= 0 (at most max_tokens): no stop before that many tokens;  ignore_eos  bool
  presence_penalty / frequency_penalty: only 0 or null (the server applies no penalties); user (string):
                metadata, accepted (it changes nothing, as OpenAI's).
`/tokenize` (`TokenizeRequest`): {"prompt": string, "add_special_tokens": bool (default true)} or {"messages",
  "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "add_special_tokens" (default false)};
  `return_token_strs`, `allow_special_tokens`. `/detokenize` (`DetokenizeRequest`): {"tokens": [int, ...]}.

Special tokens: text never becomes a control token (EOS, mask, pad, BOS, ... : the tokenizer's special added tokens
and the model config's control ids) from its literal spelling unless the request says `"allow_special_tokens":
true`. A text prompt is encoded by `dblock.tasks.tokenizer.encode_prompt`, which encodes `<eos>` in the text as the
ordinary characters (the `tokenizers` library's `encode_special_tokens`, Hugging Face's `split_special_tokens`), so a
prompt cannot end its own completion; a character the vocabulary lacks is a 400 naming the parameter, the character
and its position. Token-id prompts are taken as given. Chat messages: see `serving_chat.py` (the template's own control
tokens stay real; message text holding a special token's spelling is refused).

Bodies are JSON of at most `MAX_JSON_DEPTH` levels of nested arrays and objects (`check_json_depth`, a scan of the
raw bytes before parsing: 400 "request body nests deeper than ..." instead of a parser recursion).

Errors are OpenAI-shaped (`ErrorResponse`): {"error": {"message", "type", "param", "code"}} with status 400
(invalid), 401 (authentication), 404 (unknown model or path), 405 (wrong method), 413 (body too large), 422
(validation of a framework-parsed parameter), 429 (busy), 503 (shutting down).

Where they live (each imports only the ones above it; this module imports them all and nothing imports it back):
  protocol_base.py        APIError and the error shape, Limits, the strict request base and `NOT_HONOURED`, a
                          validation failure as one 400 naming its field, the response base, UsageInfo, the JSON
                          depth scan, `parse`
  protocol_prompt.py      prompts as token ids (`encode`, `encode_text`), within the prompt limit
  protocol_sampling.py    the sampling and stop fields completions and chat share (`_Sampling`), MAX_SEED, MAX_STOPS
  protocol_completion.py  /v1/completions: CompletionRequest, `parse_completion`, CompletionResponse
  protocol_chat.py        /v1/chat/completions: ChatMessage, ChatCompletionRequest, the response and stream chunks
  protocol_tokenize.py    /tokenize, /detokenize
  protocol_models.py      /v1/models, /version
"""
from dblock.serving.protocol_base import (ERROR_TYPES, MAX_JSON_DEPTH, NOT_HONOURED, APIError, ErrorInfo,
                                          ErrorResponse, Limits, UsageInfo, api_error, check_json_depth,
                                          json_depth_exceeds, parse)
from dblock.serving.protocol_chat import (ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                                          ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatMessage,
                                          ChatMessageOut, DeltaMessage)
from dblock.serving.protocol_completion import (CompletionChoice, CompletionRequest, CompletionResponse,
                                                parse_completion)
from dblock.serving.protocol_models import ModelCard, ModelList, VersionResponse
from dblock.serving.protocol_prompt import OPT_IN, encode, encode_text
from dblock.serving.protocol_sampling import MAX_SEED, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_STOPS, StreamOptions
from dblock.serving.protocol_tokenize import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                              TokenizeResponse)

__all__ = [
    # shared
    "APIError", "ERROR_TYPES", "ErrorInfo", "ErrorResponse", "Limits", "MAX_JSON_DEPTH", "NOT_HONOURED", "UsageInfo",
    "api_error", "check_json_depth", "json_depth_exceeds", "parse",
    # prompts
    "OPT_IN", "encode", "encode_text",
    # sampling fields
    "MAX_SEED", "MAX_STOPS", "MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS", "StreamOptions",
    # /v1/completions
    "CompletionChoice", "CompletionRequest", "CompletionResponse", "parse_completion",
    # /v1/chat/completions
    "ChatCompletionChoice", "ChatCompletionRequest", "ChatCompletionResponse", "ChatCompletionStreamChoice",
    "ChatCompletionStreamResponse", "ChatMessage", "ChatMessageOut", "DeltaMessage",
    # /tokenize, /detokenize
    "DetokenizeRequest", "DetokenizeResponse", "TokenizeRequest", "TokenizeResponse",
    # /v1/models, /version
    "ModelCard", "ModelList", "VersionResponse",
]
