"""The API benchmark's bookkeeping: the offline reference runs as the server runs its engine,
and a row is the median of alternating rounds."""

import json
import socket
import threading
import time

import pytest

from loadtests.bench_api import REQUESTS_PER_STREAM, median_row, run_offline
from serving.engine.outputs import SequenceOutput


class _Engine:
    """Records which thread generates; answers each prompt with `new` tokens."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def generate(self, prompts, params):
        self.threads.append(threading.current_thread())
        return [[SequenceOutput(0, token_ids=[1] * params.max_tokens)] for _ in prompts]


def test_offline_steps_on_a_thread_of_its_own_and_counts_every_token():
    engine = _Engine()
    tps = run_offline(engine, [[1, 2], [3]], new=5)  # type: ignore[arg-type]
    assert len(engine.threads) == REQUESTS_PER_STREAM
    assert all(t is not threading.main_thread() for t in engine.threads)
    assert tps > 0


def test_row_is_the_median_of_the_rounds_with_the_ratios_range():
    apis = [
        dict(tps=100.0, ttft=0.05, itl_p50=0.01, itl_p99=0.02),
        dict(tps=90.0, ttft=0.07, itl_p50=0.02, itl_p99=0.04),
        dict(tps=120.0, ttft=0.06, itl_p50=0.03, itl_p99=0.03),
    ]
    row = median_row(4, apis, [100.0, 200.0, 120.0])
    assert row["concurrency"] == 4
    assert row["tps"] == 100.0 and row["offline"] == 120.0
    assert row["ratio"] == pytest.approx(100 / 120)
    assert row["ttft"] == 0.06 and row["itl_p50"] == 0.02 and row["itl_p99"] == 0.03
    assert row["ratios"] == pytest.approx([1.0, 0.45, 1.0])


async def test_client_counts_the_usage_tokens_and_the_gaps_between_chunks():
    """The client against a server streaming as ours does: chunks with choices, then a usage
    chunk with none, then [DONE]."""
    import aiohttp
    from aiohttp import web

    from loadtests.bench_api import one_request, run_api

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text in ("a", "b", "c"):
            chunk = {"choices": [{"index": 0, "text": text}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await web.SockSite(runner, sock).start()
    try:
        gaps: list[float] = []
        async with aiohttp.ClientSession() as session:
            tokens, ttft = await one_request(session, f"http://127.0.0.1:{port}", [1], 7, gaps)
        start = time.monotonic()
        result = await run_api(port, [[1, 2], [3]], new=7)
        wall = time.monotonic() - start
    finally:
        await runner.cleanup()
    assert tokens == 7 and ttft > 0
    assert len(gaps) == 2  # three chunks with text; the usage chunk is not a token's
    # 2 streams x 2 requests x 7 tokens over at most the call's own time
    assert result["tps"] >= 2 * REQUESTS_PER_STREAM * 7 / wall
    assert 0 <= result["itl_p50"] <= result["itl_p99"]
