"""Structured logs and request ids.

Every log line is one JSON object on stderr (`ts`, `level`, `logger`, `message`, and any
fields passed as `extra`), so a log pipeline can index the request id, tier, status and
latency without parsing prose. A request id is the client's `X-Request-Id` when it is a
sane token, else a fresh one; it travels to the tier and back in the response headers.
"""

import json
import logging
import re
import sys
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "X-Request-Id"
# What a client may choose as its id: printable, no spaces or quotes, so it is safe to echo
# in a header and a log line (the length of a UUID with room for a prefix).
_VALID_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
# The LogRecord attributes every record has; anything else came in through `extra`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


def request_id(client_value: str | None) -> str:
    """The client's id if it is valid, else a new one (an invalid id is replaced, not
    refused: tracing must never cost a request)."""
    if client_value and _VALID_ID.fullmatch(client_value):
        return client_value
    return uuid.uuid4().hex


class JSONFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the `extra` fields and, for
    an exception, its type, message and traceback (for the operator; clients never see one)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        line |= {k: v for k, v in vars(record).items() if k not in _STANDARD}
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            line["error"] = f"{type(error).__name__}: {error}"
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_json_logging(level: int = logging.INFO) -> None:
    """Route every logger (ours, uvicorn's) through one JSON handler on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call


class RequestIdMiddleware:
    """Gives every HTTP request an id (`request_id` in its state) and echoes it in the
    `X-Request-Id` response header, on errors and refusals too. Pure ASGI."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client_value = dict(scope["headers"]).get(b"x-request-id", b"")
        rid = request_id(client_value.decode("latin-1"))
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message["headers"] = [*headers, (b"x-request-id", rid.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)
