"""The least a hop can cost: a raw ASGI app under uvicorn that forwards each POST to one
upstream over aiohttp and relays the answer's bytes as they arrive, with no parsing,
routing, limits, logging or metrics. `bench_gateway.py --canned` runs it beside the gateway, in
front of the same tier, so its added latency is the floor a Python HTTP proxy has on the
machine, measured in the same run.

    python loadtests/bare_proxy.py --port 8200 --upstream http://127.0.0.1:8101
"""

import argparse

import aiohttp
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send


def bare_proxy(upstream: str) -> ASGIApp:
    session: list[aiohttp.ClientSession] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await receive()  # startup
            session.append(aiohttp.ClientSession(auto_decompress=False))
            await send({"type": "lifespan.startup.complete"})
            await receive()  # shutdown
            await session[0].close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        headers = {"Content-Type": "application/json"}
        if scope["method"] == "GET":
            request = session[0].get(upstream + scope["path"])
        else:
            request = session[0].post(upstream + scope["path"], data=body, headers=headers)
        async with request as r:
            content_type = r.headers.get("Content-Type", "application/json").encode()
            start = {"type": "http.response.start", "status": r.status}
            await send(start | {"headers": [(b"content-type", content_type)]})
            async for chunk in r.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:8101")
    args = parser.parse_args()
    app = bare_proxy(args.upstream.rstrip("/"))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
