"""The peers benchmark's bookkeeping: when a server counts as warm, a client that survives
llama-server's closed connections, and a table that says why a row failed."""

import asyncio
import json

import httpx

from loadtests.bench_api import run_api, warm
from loadtests.bench_peers import Server, table


def test_warm_waits_for_our_background_compiles_and_takes_a_bodiless_200():
    assert not warm(httpx.Response(503, json={"status": "warming_up"}))
    body = {"status": "ok", "warmup": {"graphs_compiled": 1, "graphs_wanted": 6}}
    assert not warm(httpx.Response(200, json=body))
    assert warm(httpx.Response(200, json={"status": "ok"}))  # ours when done, llama-server's
    assert warm(httpx.Response(200))  # vLLM's


def test_a_failed_row_says_why_under_the_table():
    rows = [
        Server("llama-server, bf16", "bf16", [], {}),
        Server("tierserve engine, bf16", "bf16", [], {}),
        Server("vLLM CPU build, bf16", "bf16", [], {}),
    ]
    results = {"llama-server, bf16": {1: 100.0}, "vLLM CPU build, bf16": {1: 50.0}}
    failures = {"tierserve engine, bf16": "exited with 2: no native bfloat16 matmul"}
    text = table(results, failures, rows, [1])
    assert "| tierserve engine, bf16 | failed |" in text
    assert "| vLLM CPU build, bf16 | 50 (0.50x) |" in text
    assert text.endswith("tierserve engine, bf16 failed: exited with 2: no native bfloat16 matmul")


async def test_fresh_connections_survive_a_server_that_closes_after_each_stream():
    """As llama-server: a chunked event stream announcing keep-alive, then the socket closed."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if b"content-length" in line.lower()
        )
        new = json.loads(await reader.readexactly(length))["max_tokens"]
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nKeep-Alive: timeout=5, max=100\r\n\r\n"
        )
        events = [{"choices": [{"index": 0, "text": t}]} for t in "ab"]
        events.append({"choices": [], "usage": {"completion_tokens": new}})
        for data in [*(json.dumps(e).encode() for e in events), b"[DONE]"]:
            chunk = b"data: " + data + b"\n\n"
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        result = await run_api(port, [[1], [2]], new=5, fresh=True)
    assert result["tps"] > 0  # with a pooled connection, every second request failed
