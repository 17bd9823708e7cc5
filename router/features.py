"""Complexity features of a request: cheap signals of how hard it is to answer well.

Computed from the raw OpenAI request body (chat or completions) without a tokenizer, so the
gateway can route for any upstream in well under a millisecond. Token counts are estimates
(words and punctuation marks), which is all a routing decision needs.
"""

import math
import re
from dataclasses import dataclass
from typing import Any

_WORD = re.compile(r"\w+|[^\w\s]")
_DIGIT = re.compile(r"\d")
# An operator between two operands: `3 * 4`, `x+1`, `(a - b)`.
_OPERATION = re.compile(r"(?<=[\w)])\s*[-+*/%^]\s*(?=[\w(])")
_CODE = re.compile(
    r"```|\bdef \w+\(|\bclass \w+|\bimport \w+|\bfunction\b|\bpython\b|\bsolve\(", re.I
)
_TERMINAL = re.compile(r"\b(shell|bash|terminal|director(y|ies)|files?|folder|grep|ls)\b", re.I)
_MATH = re.compile(r"\b(compute|calculate|integer|sum|product|equation|solve for)\b", re.I)
_MULTI_STEP = re.compile(
    r"\b(step by step|then|after that|first|second|finally|each|every|prove|explain why|"
    r"and then|followed by|for each)\b",
    re.I,
)
DOMAINS = ("math", "code", "terminal", "tools", "chat")
FEATURE_NAMES = (
    "log_tokens",
    "log_digits",
    "operations",
    "code",
    "tools",
    "json_output",
    "multi_step",
    "depth",
    *(f"domain_{d}" for d in DOMAINS),
)


@dataclass(frozen=True)
class RouteRequest:
    """What the router sees of a request."""

    text: str  # every message's text, in order (the prompt for completions)
    num_messages: int
    assistant_turns: int
    has_tools: bool
    json_output: bool  # response_format asks for JSON

    @property
    def words(self) -> list[str]:
        return _WORD.findall(self.text.lower())


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def route_request(body: dict[str, Any]) -> RouteRequest:
    """The router's view of a chat (`messages`) or completions (`prompt`) request body,
    which the gateway has already checked to be of the right shape."""
    if "messages" in body:
        messages = body["messages"]
        text = "\n".join(_content_text(m.get("content")) for m in messages)
        roles = [m.get("role") for m in messages]
        assistant_turns = roles.count("assistant")
    else:
        prompt = body.get("prompt", "")
        text = prompt if isinstance(prompt, str) else "\n".join(map(str, prompt))
        messages, assistant_turns = [prompt], 0
    response_format = body.get("response_format") or {}
    return RouteRequest(
        text=text,
        num_messages=len(messages),
        assistant_turns=assistant_turns,
        has_tools=bool(body.get("tools")),
        json_output=response_format.get("type") in ("json_object", "json_schema"),
    )


def domain(request: RouteRequest) -> str:
    """The task domain the request most likely belongs to."""
    if request.has_tools:
        return "tools"
    if _CODE.search(request.text):
        return "code"
    if _TERMINAL.search(request.text):
        return "terminal"
    if _MATH.search(request.text) or _OPERATION.search(request.text):
        return "math"
    return "chat"


def features(request: RouteRequest) -> dict[str, float]:
    """The named features, each scaled to roughly [0, 3] so one weight scale fits all."""
    text = request.text
    guessed = domain(request)
    values = {
        "log_tokens": math.log1p(len(_WORD.findall(text))) / 3,
        "log_digits": math.log1p(len(_DIGIT.findall(text))) / 2,
        "operations": min(len(_OPERATION.findall(text)), 12) / 4,
        "code": float(bool(_CODE.search(text))),
        "tools": float(request.has_tools),
        "json_output": float(request.json_output),
        "multi_step": min(len(_MULTI_STEP.findall(text)), 6) / 2,
        "depth": min(request.assistant_turns, 10) / 3,
    }
    for d in DOMAINS:
        values[f"domain_{d}"] = float(d == guessed)
    return values
