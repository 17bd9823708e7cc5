"""A tier that answers without a model, in our tier's wire format: whole answers, or one SSE
event per requested token, for chat and completions. Behind the gateway it leaves only
what the hop, the limits and the load generator cost (`bench_gateway.py --canned`, the
fuzz tests, the load test's own test). `--token-delay-ms` paces the tokens like a decoder;
`--warmup-s` makes its /health answer as a `tierserve engine` compiling its decode steps does
(503 with progress) for that long after it starts.

    python loadtests/canned_tier.py --port 8101 [--token-delay-ms 0] [--warmup-s 0]
"""

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

DEFAULT_MAX_TOKENS = 16
GRAPHS = 6  # what a warming canned tier says it compiles


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) and 0 < value <= 4096 else DEFAULT_MAX_TOKENS


def canned_app(model: str = "canned", token_delay_s: float = 0.0, warmup_s: float = 0.0) -> FastAPI:
    app = FastAPI()
    ready_at = time.monotonic() + warmup_s

    def usage(completion: int) -> dict[str, int]:
        return {"prompt_tokens": 32, "completion_tokens": completion,
                "total_tokens": 32 + completion}  # fmt: skip

    async def stream(kind: str, n: int, include_usage: bool) -> AsyncIterator[bytes]:
        head = {"id": f"{kind}-canned", "created": int(time.time()), "model": model}
        chat = kind == "chatcmpl"
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i in range(n):
            piece = {"delta": {"content": " word"}} if chat else {"text": " word"}
            done = "length" if i == n - 1 else None
            choice = {"index": 0, **piece, "finish_reason": done}
            yield f"data: {json.dumps(head | {'object': obj, 'choices': [choice]})}\n\n".encode()
            await asyncio.sleep(token_delay_s)  # one write per event, as a real tier makes
        if include_usage:
            event = head | {"object": obj, "choices": [], "usage": usage(n)}
            yield f"data: {json.dumps(event)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def answer(request: Request, kind: str) -> Response:
        body = await request.json()
        n = _max_tokens(body)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(stream(kind, n, include_usage), media_type="text/event-stream")
        await asyncio.sleep(token_delay_s * n)
        if kind == "chatcmpl":
            choice = {"index": 0, "message": {"role": "assistant", "content": " word" * n}}
            obj = "chat.completion"
        else:
            choice, obj = {"index": 0, "text": " word" * n}, "text_completion"
        data = {"id": f"{kind}-canned", "object": obj, "created": int(time.time()),
                "model": model, "choices": [choice | {"finish_reason": "length"}],
                "usage": usage(n)}  # fmt: skip
        return Response(json.dumps(data), media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await answer(request, "chatcmpl")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, "cmpl")

    @app.get("/health")
    async def health() -> Response:
        left = ready_at - time.monotonic()
        if left > 0:
            compiled = int(GRAPHS * (1 - left / warmup_s))
            message = f"Warming up: {compiled} of {GRAPHS} decode graphs compiled."
            error = {"message": message, "type": "server_error", "param": None,
                     "code": "warming_up"}  # fmt: skip
            warmup = {"graphs_compiled": compiled, "graphs_wanted": GRAPHS}
            body = {"error": error, "status": "warming_up", "warmup": warmup}
            return Response(json.dumps(body), 503, {"Retry-After": "1"}, "application/json")
        return Response(json.dumps({"status": "ok"}), media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response("", media_type="text/plain")

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="canned")
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument("--warmup-s", type=float, default=0.0)
    args = parser.parse_args()
    app = canned_app(args.model, args.token_delay_ms / 1000, args.warmup_s)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
