"""Cascade validators: cheap checks that a highspeed answer is usable, so the gateway can
escalate to the full tier when it is not (non-streaming requests only, opt-in).

Each check is one the request itself implies: a JSON `response_format`, the offered tools'
parameter schemas, and the answer format of the task's domain, read by the verifiers' own
extraction (`tasks/answers.py`): an integer for arithmetic, a program that parses for code,
one command block or DONE for the terminal. A truncated answer
(`finish_reason: length`) always fails.
"""

import ast
import json
from collections.abc import Mapping
from typing import Any

import jsonschema

from router.features import domain, route_request
from tasks.answers import extract_program, final_integer, parse_command_turn


def _check_json(content: str, response_format: Mapping[str, Any]) -> str | None:
    try:
        value = json.loads(content)
    except json.JSONDecodeError:
        return "invalid_json"
    if response_format.get("type") == "json_object" and not isinstance(value, dict):
        return "invalid_json"
    schema = (response_format.get("json_schema") or {}).get("schema")
    if schema is not None:
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError:
            return "schema_mismatch"
        except jsonschema.SchemaError:
            return None  # the client's schema is broken; not the answer's fault
    return None


def _check_tool_calls(calls: list[Mapping[str, Any]], tools: list[Mapping[str, Any]]) -> str | None:
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
    for call in calls:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        if name not in schemas:
            return "unknown_tool"
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return "invalid_tool_arguments"
        try:
            if schemas[name] is not None:
                jsonschema.validate(value, schemas[name])
        except jsonschema.ValidationError:
            return "invalid_tool_arguments"
        except jsonschema.SchemaError:
            continue
    return None


def _check_domain(expected: str, content: str) -> str | None:
    """The answer read as its domain's verifier reads it (`tasks.answers`): a program that
    parses, a final integer, a valid terminal turn."""
    if expected == "code":
        program = extract_program(content)
        try:
            ast.parse(program)
        except (SyntaxError, ValueError):
            return "no_valid_code"
        if not program.strip():
            return "no_valid_code"
    elif expected == "math" and final_integer(content) is None:
        return "no_final_number"
    elif expected == "terminal" and parse_command_turn(content)[2] is not None:
        return "no_command"
    return None


def validate_answer(body: Mapping[str, Any], response: Mapping[str, Any]) -> str | None:
    """Why the answer to `body` fails its checks (a short code), or None when it passes."""
    expected = domain(route_request(dict(body)))
    response_format = body.get("response_format") or {}
    for choice in response.get("choices") or []:
        if choice.get("finish_reason") == "length":
            return "truncated"
        message = choice.get("message") or {}
        content = message.get("content") or choice.get("text") or ""
        if response_format.get("type") in ("json_object", "json_schema"):
            failure = _check_json(content, response_format)
        elif message.get("tool_calls"):
            failure = _check_tool_calls(message["tool_calls"], body.get("tools") or [])
        else:
            failure = _check_domain(expected, content)
        if failure:
            return failure
    return None
