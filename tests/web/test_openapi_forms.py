"""The OpenAPI document's multipart forms, as Swagger UI's try-it uses them (no worker needed)."""

from __future__ import annotations

import pytest

from web.app import create_app


@pytest.fixture(scope="module")
def document(module_settings):
    """/openapi.json of the app (read once: the tests only read it)."""
    return create_app(module_settings).test_client().get("/openapi.json").get_json()


def form_fields(document: dict):
    """(path, method, field, its schema) of every multipart form field of every operation."""
    schemas = document["components"]["schemas"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            content = operation.get("requestBody", {}).get("content", {}) if isinstance(operation, dict) else {}
            for mimetype, body in content.items():
                schema = body["schema"]
                schema = schemas[schema["$ref"].rsplit("/", 1)[-1]] if "$ref" in schema else schema
                if mimetype == "multipart/form-data":
                    yield from ((path, method, name, prop) for name, prop in schema.get("properties", {}).items())


def test_no_form_field_has_a_null_default(document):
    """Swagger UI's try-it sends a `default: null` as the text "null" (a 400 for `language` and `prompt`)."""
    fields = list(form_fields(document))
    assert {path for path, *_ in fields} >= {"/v1/audio/transcriptions", "/v1/audio/translations",
                                             "/v1/jobs/transcriptions"}
    nulls = [(path, name) for path, _, name, prop in fields if "default" in prop and prop["default"] is None]
    assert not nulls
    assert not [(path, name) for path, _, name, prop in fields if None in prop.get("enum", ())]


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations"])
def test_each_text_format_has_its_content_type_documented(document, path):
    content = document["paths"][path]["post"]["responses"]["200"]["content"]
    assert {"application/json", "text/plain", "application/x-subrip", "text/vtt", "text/event-stream"} <= set(content)
