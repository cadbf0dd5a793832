"""OpenAI-compatible embeddings: POST /v1/embeddings (a sync job on `interactive`, its inputs encoded together with
other requests' on the worker: workers/backends/embeddings.py)."""

from __future__ import annotations

from jobs import queues
from web import intake
from web.jobrun import answer, submit
from web.jsonbody import Blueprint
from web.render.embeddings import Embeddings
from web.response_schemas import EmbeddingListSchema
from web.schemas import EmbeddingRequestSchema

blp = Blueprint("embeddings", __name__, url_prefix="/v1", description="OpenAI-compatible embeddings")


@blp.route("/embeddings", methods=["POST"])
@blp.arguments(EmbeddingRequestSchema())
@blp.response(200, EmbeddingListSchema, description="A list of embedding objects, in the inputs' order")
def embeddings(body):
    """Create one embedding vector per input (floats, or base64 with `encoding_format`)."""
    request = intake.embedding_request(body, queues.new_job_id("embd"))
    submit(request, queues.EMBEDDING, f"embed {len(request.inputs)} inputs ({request.model.id})")
    return answer(request.id, Embeddings(body["encoding_format"]))
