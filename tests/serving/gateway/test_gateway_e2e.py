"""`tierserve serve` end to end: a real gateway process supervising two real tier processes
(random-weight checkpoints), driven by the official openai client."""

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.serving.gateway.processes import NAMES, Gateway, alive, child_pids, start_gateway, stop

pytestmark = pytest.mark.slow
USER = [{"role": "user", "content": "Write a haiku about the sea."}]
TOOLS = [{"type": "function", "function": {"name": n}} for n in ["get_date", "get_time"]]


@pytest.fixture(scope="module")
def gateway(random_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = start_gateway(random_checkpoint, tmp_path_factory.mktemp("gateway"))
    pids = child_pids(gw)
    try:
        yield gw
    finally:
        stop(gw, pids + child_pids(gw))


@pytest.fixture
def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


def test_sync_chat_says_which_tier_answered(client: openai.OpenAI):
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=USER, max_tokens=5, temperature=0
    )
    tier = raw.headers["x-tierserve-tier"]
    completion = raw.parse()
    assert completion.model == NAMES[tier]
    assert completion.usage.completion_tokens == 5
    extra = completion.model_extra["tierserve"]
    assert extra["tier"] == tier and extra["policy"] == "heuristic" and 0 <= extra["score"] <= 1


def test_streaming_chat_and_completions(client: openai.OpenAI):
    chunks = list(
        client.chat.completions.create(
            model="highspeed", messages=USER, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert all(c.model == NAMES["highspeed"] for c in chunks)
    assert chunks[-1].usage.completion_tokens == 6
    completion = client.completions.create(model="full", prompt="def main():", max_tokens=3)
    assert completion.model == NAMES["full"] and completion.usage.completion_tokens == 3


def test_forced_tool_call_through_the_gateway(client: openai.OpenAI):
    kwargs = {"model": "full", "messages": USER, "tools": TOOLS, "tool_choice": "required"}
    kwargs |= {"max_tokens": 80, "temperature": 1.0, "seed": 9}
    [choice] = client.chat.completions.create(**kwargs).choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name in {"get_date", "get_time"}
    assert isinstance(json.loads(call.function.arguments), dict)


@pytest.mark.parametrize(
    ("extra", "headers", "tier"),
    [
        ({"model": "full"}, {}, "full"),
        ({"model": "tiny-fast"}, {}, "highspeed"),
        ({"model": "auto", "reasoning_effort": "high"}, {}, "full"),
        ({"model": "full"}, {"X-Tierserve-Tier": "highspeed"}, "highspeed"),
    ],
)
def test_overrides(client: openai.OpenAI, extra, headers, tier):
    raw = client.chat.completions.with_raw_response.create(
        messages=USER, max_tokens=2, extra_headers=headers, **extra
    )
    assert raw.headers["x-tierserve-tier"] == tier and raw.parse().model == NAMES[tier]


def _normalised(stream: bytes) -> bytes:
    """The stream with what differs between two requests by necessity: the request id and
    the creation time, which the tier stamps on each request."""
    stream = re.sub(rb'"id": ?"[^"]*"', b'"id":""', stream)
    return re.sub(rb'"created": ?\d+', b'"created":0', stream)


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_is_byte_identical_to_the_tier(gateway: Gateway, include_usage: bool):
    body = {"messages": USER, "max_tokens": 8, "temperature": 0, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    tier_url = gateway.health()["tiers"]["full"]["url"]
    through = httpx.post(f"{gateway.url}/v1/chat/completions", json=body | {"model": "full"})
    direct = httpx.post(f"{tier_url}/chat/completions", json=body | {"model": NAMES["full"]})
    assert through.status_code == direct.status_code == 200
    assert through.headers["content-type"] == direct.headers["content-type"]
    assert _normalised(through.content) == _normalised(direct.content)
    assert through.content.endswith(b"data: [DONE]\n\n")


def test_tokenize_and_detokenize_through_the_gateway(gateway: Gateway):
    tokens = httpx.post(f"{gateway.url}/tokenize", json={"model": "auto", "prompt": "hello"})
    assert tokens.status_code == 200 and tokens.json()["count"] > 0
    text = httpx.post(
        f"{gateway.url}/detokenize", json={"model": "highspeed", "tokens": tokens.json()["tokens"]}
    )
    assert text.json()["prompt"] == "hello"


def test_bad_input_is_an_openai_error(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as bad:  # the tier's own validation
        client.chat.completions.create(model="full", messages=USER, temperature=7)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=USER)


def test_metrics_count_requests_and_scrape_the_tiers(gateway: Gateway, client: openai.OpenAI):
    client.chat.completions.create(model="full", messages=USER, max_tokens=2)
    text = httpx.get(f"{gateway.url}/metrics").text
    assert re.search(
        r'tierserve_gateway_requests_total\{outcome="success",tier="full"\} [1-9]', text
    )
    assert "tierserve_gateway_overhead_seconds_bucket" in text
    tier = httpx.get(f"{gateway.url}/metrics/tiers/full").text
    assert 'tierserve_generation_tokens_total{model_name="tiny-full"}' in tier


def test_killed_tier_falls_back_then_restarts(gateway: Gateway, client: openai.OpenAI):
    pid = gateway.health()["tiers"]["full"]["pid"]
    os.kill(pid, signal.SIGKILL)
    raw = client.chat.completions.with_raw_response.create(
        model="full", messages=USER, max_tokens=2
    )
    assert raw.headers["x-tierserve-tier"] == "highspeed"
    assert raw.headers["x-tierserve-reason"] in ("fallback", "tier_down")
    health = gateway.wait_healthy()
    assert health["tiers"]["full"]["restarts"] == 1 and health["tiers"]["full"]["pid"] != pid
    assert (
        client.chat.completions.create(model="full", messages=USER, max_tokens=2).model
        == (NAMES["full"])
    )


def test_sigterm_drains_and_leaves_no_orphans(gateway: Gateway):
    """Runs last: a stream in flight at SIGTERM completes, then the tiers stop."""
    pids = child_pids(gateway)
    body = {"model": "highspeed", "messages": USER, "max_tokens": 64, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    received: list[bytes] = []

    def stream() -> None:
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body) as r:
            received.extend(r.iter_bytes())

    reader = threading.Thread(target=stream)
    reader.start()
    time.sleep(0.5)
    gateway.process.send_signal(signal.SIGTERM)
    reader.join(timeout=60)
    assert b"".join(received).endswith(b"data: [DONE]\n\n")
    # uvicorn re-raises the signal once shut down, so a clean exit reads as -SIGTERM.
    assert gateway.process.wait(timeout=60) in (0, -signal.SIGTERM)
    assert not [pid for pid in pids if alive(pid)]


def test_tiers_die_with_a_killed_gateway(random_checkpoint: Path, tmp_path: Path):
    """Even SIGKILL, which leaves the gateway no chance to clean up, leaves no orphans."""
    gw = start_gateway(random_checkpoint, tmp_path)
    pids = child_pids(gw)
    try:
        gw.process.kill()
        gw.process.wait(timeout=10)
        deadline = time.monotonic() + 30
        while [pid for pid in pids if alive(pid)]:
            assert time.monotonic() < deadline, "tier processes outlived the gateway"
            time.sleep(0.2)
    finally:
        stop(gw, pids)
