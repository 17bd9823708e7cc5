"""Faults, each with real processes or real sockets: SIGKILL of a tier under load, a slow
upstream, a malformed upstream, and a gateway restart."""

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Response
from fastapi.responses import StreamingResponse

from serving.gateway.app import build_gateway_app
from serving.gateway.config import FallbackConfig, GatewayConfig, RemoteTier
from serving.gateway.proxy import UpstreamFailure, post
from serving.gateway.upstream import TierState, free_port, make_upstream
from tests.serving.gateway.processes import (
    NAMES,
    alive,
    child_pids,
    settles,
    start_gateway,
    state,
    stop,
)

USER = [{"role": "user", "content": "Write a haiku about the sea."}]
# A hang guard, not the target: how fast a killed tier is back at full speed is measured by
# `python -m loadtests.bench_startup --kill`, on a machine doing nothing else.
RECOVERY_LIMIT_S = 60.0


def chat(url: str, model: str, timeout: float = 30, **extra) -> httpx.Response:
    body = {"model": model, "messages": USER, "max_tokens": 2} | extra
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)


class Stream(threading.Thread):
    """A long stream pinned to one tier, read in the background."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model = url, model
        self.started = threading.Event()
        self.received = b""

    def run(self) -> None:
        # Long enough to be in flight at the kill however fast the compiled steps decode.
        body = {"model": self.model, "messages": USER, "max_tokens": 960, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=60) as r:
            for chunk in r.iter_raw():
                self.received += chunk
                self.started.set()


class Load(threading.Thread):
    """Small requests to `auto` and to each tier, one after another, until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.statuses: list[int] = []

    def run(self) -> None:
        models = ["auto", "full", "highspeed"]
        while not self.stop.is_set():
            self.statuses.append(chat(self.url, models[len(self.statuses) % 3]).status_code)


@pytest.mark.slow
@pytest.mark.serial
def test_sigkill_of_a_tier_under_load(random_checkpoint: Path, tmp_path: Path):
    """In-flight streams on the killed tier end with an error event, new requests fall over
    to the other tier, the supervisor restarts it from its standby, and the full tier serves
    again once it is ready (its compiled decode steps loaded), no request lost meanwhile."""
    gw = start_gateway(random_checkpoint, tmp_path, enforce_eager=False, max_model_len=1024)
    try:
        while not (full := gw.health()["tiers"]["full"])["standby_ready"]:
            time.sleep(0.1)  # started once the tier is ready, ready once past its imports
        standby_pid = full["standby_pid"]
        pids = child_pids(gw)
        assert standby_pid in pids
        assert policies(standby_pid) == {os.SCHED_IDLE}  # its imports yield to the tiers
        full_pid = gw.health()["tiers"]["full"]["pid"]
        streams = [Stream(gw.url, "full") for _ in range(3)]
        load = Load(gw.url)
        streams[0].start()
        assert streams[0].started.wait(60)
        # Held stopped while one request is in flight: it takes no CPU from a lone stream.
        assert settles(lambda: state(standby_pid) == "T")
        for thread in [*streams[1:], load]:
            thread.start()
        assert all(s.started.wait(60) for s in streams)
        assert settles(lambda: state(standby_pid) != "T")  # several: on at idle priority
        killed = time.monotonic()
        os.kill(full_pid, signal.SIGKILL)
        during = chat(gw.url, "full")
        assert during.status_code == 200
        assert during.headers["x-tierserve-tier"] == "highspeed"
        assert during.headers["x-tierserve-reason"] in ("fallback", "tier_down")
        while True:  # recovered: a request for the full tier is answered by it again
            response = chat(gw.url, "full")
            if response.headers.get("x-tierserve-tier") == "full":
                recovery_s = time.monotonic() - killed
                break
            assert time.monotonic() - killed < RECOVERY_LIMIT_S, "the full tier never came back"
            time.sleep(0.1)
        print(f"recovery after SIGKILL: {recovery_s:.2f} s")
        load.stop.set()
        for thread in [*streams, load]:
            thread.join(60)
        for s in streams:
            assert b'data: {"error"' in s.received, s.received[-300:]
            assert s.received.endswith(b"data: [DONE]\n\n")
        assert load.statuses and set(load.statuses) == {200}, load.statuses
        health = gw.health()
        assert health["status"] == "ok" and health["tiers"]["full"]["restarts"] == 1
        assert health["tiers"]["full"]["pid"] == standby_pid
        assert policies(standby_pid) == {os.SCHED_OTHER}  # serving at normal priority
        new_standby = health["tiers"]["full"]["standby_pid"]
        assert new_standby not in (None, standby_pid)
        assert settles(lambda: state(new_standby) != "T")  # nothing in flight: it goes on
        assert settles(lambda: gw.health()["tiers"]["full"]["standby_ready"], 60)
    finally:
        stop(gw, child_pids(gw))


def policies(pid: int) -> set[int]:
    """The scheduling policies of a process's threads."""
    return {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def _bindable(port: int) -> bool:
    """Whether a server could listen on the port again (as uvicorn does, SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.slow
def test_gateway_restart_leaves_no_orphans_and_frees_its_ports(
    random_checkpoint: Path, tmp_path: Path
):
    ports = {"gateway": free_port(), "full": free_port(), "highspeed": free_port()}
    gw = start_gateway(random_checkpoint, tmp_path, ports)
    pids = child_pids(gw)
    try:
        assert chat(gw.url, "auto").status_code == 200
        gw.process.send_signal(signal.SIGTERM)
        gw.process.wait(timeout=60)
        assert not [pid for pid in pids if alive(pid)]
        assert all(_bindable(port) for port in ports.values())
        again = start_gateway(random_checkpoint, tmp_path, ports)  # the same ports
        pids += child_pids(again)
        response = chat(again.url, "full")
        assert response.status_code == 200 and response.json()["model"] == NAMES["full"]
        stop(again, pids)
        assert not [pid for pid in pids if alive(pid)]
    finally:
        stop(gw, pids)


def fake_upstream() -> FastAPI:
    """An OpenAI server gone wrong: `/slow` answers after 30 s (or stalls a stream after its
    first event), `/garbage` answers 200 with HTML."""
    app = FastAPI()

    @app.post("/slow/v1/chat/completions")
    async def slow(body: dict) -> Response:
        import asyncio

        async def stalled():
            yield b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
            await asyncio.sleep(30)

        if body.get("stream"):
            return StreamingResponse(stalled(), media_type="text/event-stream")
        await asyncio.sleep(30)
        return Response("{}")

    @app.post("/garbage/v1/chat/completions")
    async def garbage() -> Response:
        return Response("<html>502 Bad Gateway</html>", media_type="text/html")

    return app


@pytest.fixture(scope="module")
def upstream_url() -> Iterator[str]:
    port = free_port()
    config = uvicorn.Config(fake_upstream(), port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = server.force_exit = True  # the stalled streams need not finish
    thread.join(10)


def gateway_client(base: str, mode: str, **config: object) -> httpx.AsyncClient:
    """The gateway in process, both tiers at the fake upstream's `mode` path."""
    tiers = {
        tier: {"engine": "remote", "base_url": f"{base}/{mode}/v1", "model": f"{mode}-{tier}"}
        for tier in ("full", "highspeed")
    }
    app = build_gateway_app(GatewayConfig.model_validate({"tiers": tiers} | config))
    for upstream in app.state.gateway.upstreams.values():
        upstream.state = TierState.HEALTHY
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw")


async def test_slow_upstream_times_out_with_a_clear_error(upstream_url: str):
    body = {"messages": USER, "max_tokens": 2}
    async with gateway_client(upstream_url, "slow", fallback={"read_timeout_s": 0.5}) as c:
        start = time.monotonic()
        response = await c.post("/v1/chat/completions", json=body)
        elapsed = time.monotonic() - start
    assert response.status_code == 504 and elapsed < 5  # two tries of 0.5 s, not 30 s
    error = response.json()["error"]
    assert error["code"] == "timeout" and "timed out" in error["message"]
    limits = {"request_timeout_s": 0.5}
    async with gateway_client(upstream_url, "slow", limits=limits) as c:
        stream = await c.post("/v1/chat/completions", json=body | {"stream": True})
    assert stream.status_code == 200  # the first event came: the stream ends with an error
    assert b'"code": "request_timeout"' in stream.content
    assert stream.content.endswith(b"data: [DONE]\n\n")


async def test_malformed_upstream_is_a_502_with_an_error_body(upstream_url: str):
    async with gateway_client(upstream_url, "garbage") as c:
        response = await c.post("/v1/chat/completions", json={"messages": USER})
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "malformed_response"
    assert "<html>" not in error["message"]


@pytest.mark.parametrize("peer", ["refuses", "hangs_up"])
async def test_a_lost_connection_is_not_called_a_timeout(peer: str):
    """The tier client (aiohttp under httpx's API) reports a refused connection, and one the
    tier closes before answering, as unreachable, not as timed out."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if peer == "refuses":
        listener.close()
    else:
        listener.listen()
        threading.Thread(target=lambda: listener.accept()[0].close(), daemon=True).start()
    tier = {"engine": "remote", "base_url": f"http://127.0.0.1:{port}/v1", "model": "m"}
    upstream = make_upstream("full", RemoteTier.model_validate(tier), FallbackConfig(), 4, 5.0)
    try:
        with pytest.raises(UpstreamFailure) as failure:
            await post(upstream, f"http://127.0.0.1:{port}/v1/chat/completions", b"{}", {}, False)
    finally:
        await upstream.client.aclose()
        listener.close()
    assert failure.value.cause == "connect_error", failure.value
    assert "unreachable" in str(failure.value) and upstream.in_flight == 0
