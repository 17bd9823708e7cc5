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
# Plain substring tests (of the lower-cased text): a regex per cue costs far more.
_CODE_CUES = ("```", "def ", "class ", "import ", "function", "python", "solve(")
# A request that names the shell is a terminal one even when it asks for a ```bash block.
_SHELL_CUES = ("shell", "bash", "terminal")
_TERMINAL_CUES = (*_SHELL_CUES, "director", " file", "folder", "grep ", " ls ")
_MATH_CUES = ("compute", "calculate", "integer", " sum ", "product", "equation", "solve for")
_MULTI_STEP_CUES = (
    "step by step", " then ", "after that", "first", "second", "finally", " each ",
    " every ", "prove", "explain why", "followed by",
)  # fmt: skip
_DIGITS = tuple("0123456789")
# The n-grams of a long prompt come from its first and last words; counts use all of it.
MAX_WORDS = 256
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
        """Lower-cased words and punctuation marks (the first and last MAX_WORDS / 2)."""
        text = self.text.lower()
        if len(text) > 8 * MAX_WORDS:
            text = text[: 4 * MAX_WORDS] + " " + text[-4 * MAX_WORDS :]
        words = _WORD.findall(text)
        if len(words) > MAX_WORDS:
            words = words[: MAX_WORDS // 2] + words[-MAX_WORDS // 2 :]
        return words


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        # Only well-formed text parts count: the tier, not the router, rejects the rest.
        return " ".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
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


def _has(text: str, cues: tuple[str, ...]) -> bool:
    return any(cue in text for cue in cues)


def _count(text: str, cues: tuple[str, ...]) -> int:
    return sum(text.count(cue) for cue in cues)


def _domain(request: RouteRequest, lower: str, operations: int) -> str:
    if request.has_tools:
        return "tools"
    if _has(lower, _SHELL_CUES):
        return "terminal"
    if _has(lower, _CODE_CUES):
        return "code"
    if _has(lower, _TERMINAL_CUES):
        return "terminal"
    if operations or _has(lower, _MATH_CUES):
        return "math"
    return "chat"


def _operations(text: str) -> int:
    """Arithmetic operators (spaced binary ones count once)."""
    spaced = text.count(" + ") + text.count(" - ") + text.count(" * ") + text.count(" / ")
    tight = text.count("+") + text.count("*") + text.count("^") + text.count("%")
    return spaced + max(0, tight - text.count(" + ") - text.count(" * "))


def domain(request: RouteRequest) -> str:
    """The task domain the request most likely belongs to."""
    return _domain(request, request.text.lower(), _operations(request.text))


def features(request: RouteRequest) -> dict[str, float]:
    """The named features, each scaled to roughly [0, 3] so one weight scale fits all."""
    text = request.text
    lower = text.lower()
    operations = _operations(text)
    guessed = _domain(request, lower, operations)
    # Words plus punctuation marks approximate the token count without a tokenizer.
    approx_tokens = len(text.split()) + _count(text, (".", ",", "(", ")", ":", "?"))
    values = {
        "log_tokens": math.log1p(approx_tokens) / 3,
        "log_digits": math.log1p(_count(text, _DIGITS)) / 2,
        "operations": min(operations, 12) / 4,
        "code": float(_has(lower, _CODE_CUES)),
        "tools": float(request.has_tools),
        "json_output": float(request.json_output),
        "multi_step": min(_count(lower, _MULTI_STEP_CUES), 6) / 2,
        "depth": min(request.assistant_turns, 10) / 3,
    }
    for d in DOMAINS:
        values[f"domain_{d}"] = float(d == guessed)
    return values
