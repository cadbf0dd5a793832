"""GET /v1/models and /v1/models/{id}: what the model store and the local HF cache hold."""

from __future__ import annotations

from jobs.adapters import adapters_by_model, adapters_of
from jobs.store import ModelNotFound, list_models, public_source, resolve
from web.errors import APIError
from web.intake import sampling_defaults
from web.jsonbody import Blueprint
from web.schemas import ModelListSchema, ModelSchema
from web.services import services

blp = Blueprint("models", __name__, url_prefix="/v1/models", description="Models the worker can serve")


def _as_openai(info, adapters: dict) -> dict:
    """Render a catalog entry in OpenAI's model shape plus mlxq's facts (`adapters`: jobs.adapters.adapters_by_model)."""
    return {"id": info.id, "object": "model", "created": info.created, "owned_by": "mlxq", "kind": info.kind,
            "capabilities": list(info.capabilities), "context_length": info.context_length, "size_bytes": info.size_bytes,
            "quantization": info.quantization, "source": public_source(info.source),
            "sampling_defaults": sampling_defaults(info) if info.kind in ("text", "vision") else {},
            "adapters": adapters_of(info, adapters), **({"dimensions": info.dimensions} if info.dimensions else {})}


@blp.route("", methods=["GET"])
@blp.response(200, ModelListSchema)
def list_all():
    """List every model the worker can load."""
    settings = services().settings
    adapters = adapters_by_model(settings)
    return {"object": "list", "data": [_as_openai(m, adapters) for m in list_models(settings)]}


@blp.route("/<path:model_id>", methods=["GET"])
@blp.response(200, ModelSchema)
def get_one(model_id: str):
    """Describe one model, by any reference the resolver accepts."""
    try:
        settings = services().settings
        return _as_openai(resolve(model_id, settings, allow_paths=False), adapters_by_model(settings))
    except ModelNotFound as exc:
        raise APIError(404, exc.public_message, "model_not_found", "model") from None
