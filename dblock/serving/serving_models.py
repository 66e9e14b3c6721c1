"""What is served (`OpenAIServingModels`): `/v1/models` (the served model in OpenAI's list shape, with vLLM's
`max_model_len`), `/v1/models/{id}` (that model, or 404 for any other id), and `/version` (dblock's version)."""
from __future__ import annotations

from dblock.serving.protocol_base import APIError
from dblock.serving.protocol_models import ModelCard, ModelList, VersionResponse
from dblock.serving.responses import _error


class OpenAIServingModels:
    """GET /v1/models, /v1/models/{id} and /version for the model served as `model_name` since `created` (a Unix
    time), with `max_model_len` positions (0: unknown, left out of the card)."""

    def __init__(self, model_name: str, created: int, max_model_len: int = 0):
        self.model_name, self.created, self.max_model_len = model_name, created, max_model_len

    def card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, root=self.model_name,
                         max_model_len=self.max_model_len or None)

    async def show_available_models(self):
        return ModelList(data=[self.card()]).model_dump()

    async def show_model(self, model_id: str):
        model_name = self.model_name
        if model_id != model_name:
            return _error(APIError(404, f"model: {model_id!r} is not served here (serving {model_name!r})", "model",
                                   "model_not_found"))
        return self.card().model_dump()

    async def show_version(self):
        from dblock import __version__
        return VersionResponse(version=__version__).model_dump()
