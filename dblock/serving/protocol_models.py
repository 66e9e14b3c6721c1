"""`/v1/models` and `/version` bodies: `ModelCard` (the served model, OpenAI's shape plus vLLM's `max_model_len`),
`ModelList`, `VersionResponse`."""
from __future__ import annotations

from typing import Optional

from dblock.serving.protocol_base import _Out


class ModelCard(_Out):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "dblock"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Out):
    object: str = "list"
    data: list[ModelCard]


class VersionResponse(_Out):
    version: str
