"""The OpenAPI document of the ingress: request bodies and error responses described.

The ingress's endpoints read the raw body (``intake.py`` parses it, a large one
off the event loop) and are served past FastAPI (``http_guard.py``'s routes), so
FastAPI cannot infer their bodies; ``describe(app)`` makes the app's
``/openapi.json`` name each endpoint's request model and its OpenAI-shaped errors.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from splitserve.cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
ERRORS = {
    "400": "the body is malformed or a field is out of range (the error names it)",
    "401": "the API key is missing or wrong",
    "404": "the model is not served here",
    "413": "the body is larger than http.max_body_bytes",
    "415": "the body is not application/json",
    "500": "the request failed in a worker (the error names the request)",
    "503": "the server is overloaded; retry later",
}
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def describe(app: FastAPI) -> None:
    """From now on ``app.openapi()`` (``/openapi.json``) describes the bodies and errors."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app)
        return app.openapi_schema

    app.openapi = openapi


def document(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    models = [(model, "validation") for model in BODIES.values()]
    _, schemas = models_json_schema(models, ref_template="#/components/schemas/{model}")
    doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas["$defs"])
    doc["components"]["schemas"]["Error"] = ERROR_SCHEMA
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for path, model in BODIES.items():
        operation = doc["paths"].get(path, {}).get("post")
        if operation is None:
            continue
        operation["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        }
        responses = operation.setdefault("responses", {})
        responses["200"] = {
            "description": "the completion (JSON), or its chunks (text/event-stream)",
            "content": {"application/json": {"schema": {"type": "object"}}},
        }
        for status, why in ERRORS.items():
            responses[status] = {"description": why, "content": error}
    return doc
