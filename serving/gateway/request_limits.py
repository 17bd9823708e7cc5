"""Size limits on what a client may send: the body in bytes (checked as it arrives, so an
oversized upload is cut off, not buffered) and the prompt in characters, plus the token
estimate that rate limiting charges before the tier has counted anything."""

from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.api_server.serving_engine import APIError

# OpenAI's default max_tokens for completions; chat requests without one are charged this
# too, and settled against the real usage when they end.
DEFAULT_MAX_TOKENS = 256
CHARS_PER_TOKEN = 4  # a deliberately rough estimate: it is corrected by the real usage


class BodyLimit:
    """Answers 413 to a body over `max_bytes`, by its Content-Length or, when that is absent
    or lies, by counting the bytes as they arrive (the app's error handler then answers the
    APIError raised from its read). Pure ASGI, so streams pass untouched."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, on_reject: Callable[[], None] = lambda: None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject  # counts the refusal

    def _error(self) -> APIError:
        self.on_reject()
        return APIError(
            413, f"The request body exceeds {self.max_bytes} bytes.", code="body_too_large"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._error().response()(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._error()
            return message

        await self.app(scope, counted_receive, send)


def prompt_chars(body: dict[str, Any]) -> int:
    """Characters of text a request asks the model to read: message contents (strings or
    text parts) or the completion prompt(s); token-id prompts count one per id."""
    if "messages" in body:
        total = 0
        for message in body["messages"]:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(str(p.get("text", ""))) for p in content if isinstance(p, dict))
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) if isinstance(p, str | list) else 1 for p in prompt)
    return 0


def check_prompt(body: dict[str, Any], max_chars: int) -> int:
    """The prompt's length in characters; a 400 if it is over the limit."""
    chars = prompt_chars(body)
    if chars > max_chars:
        param = "messages" if "messages" in body else "prompt"
        raise APIError(
            400,
            f"The prompt has {chars} characters; this gateway accepts at most {max_chars}.",
            param=param,
            code="prompt_too_long",
        )
    return chars


def estimated_tokens(body: dict[str, Any], chars: int) -> int:
    """What a request may cost in tokens, before any tier has counted it."""
    requested = body.get("max_completion_tokens") or body.get("max_tokens")
    completion = requested if isinstance(requested, int) and requested > 0 else DEFAULT_MAX_TOKENS
    n = body.get("n") if isinstance(body.get("n"), int) and body["n"] > 0 else 1
    return chars // CHARS_PER_TOKEN + 1 + completion * n
