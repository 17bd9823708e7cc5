"""The request bodies the gateway checks, and their OpenAPI description.

The gateway checks only the fields routing and limits need (the tier validates the rest and
its 4xx passes through), and what goes upstream is the client's own body, not a copy made
through a model. The same models describe the bodies in the OpenAPI schema, so clients and
fuzzers (schemathesis) see what the endpoints take.
"""

from typing import Annotated, Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema

from serving.api_server.serving_engine import APIError

_REF = "#/components/schemas/{model}"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id, ...
    role: str
    content: str | list[dict[str, Any]] | None = None


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # everything else is the tier's to validate
    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = None
    temperature: float | None = None


class ChatBody(_Body):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None


class CompletionBody(_Body):
    prompt: str | Annotated[list[Any], Field(min_length=1)]


class TokenizerBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None


async def read_body(request: Request, shape: type[BaseModel]) -> dict[str, Any]:
    """The JSON body as the client sent it, checked against `shape` but not copied through
    it: what goes upstream is the client's own body."""
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"The request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    try:
        shape.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e
    return body


def body_schema(shape: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for an endpoint that reads its body itself: the body is `shape`."""
    schema = {"$ref": _REF.format(model=shape.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def describe_bodies(app: FastAPI, shapes: list[type[BaseModel]]) -> None:
    """Add the body models to the app's OpenAPI components (FastAPI lists only the models
    of parameters it parses itself)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(s, "validation") for s in shapes], ref_template=_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
