"""Property test (hypothesis) of the gateway's SSE relay: whatever events a tier sends and
however the bytes are cut into reads, the client gets exactly the events, whole and in
order, minus only the usage event the gateway asked for (whose usage is still counted).
"""

import asyncio
import json
from types import SimpleNamespace

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from router.policy import Decision
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.proxy import Attempt, RequestRecord, relay

# Text as clients send it: any unicode but surrogates, SSE's own separators included.
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def event(data: dict) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[bytes], list[bytes]]:
    """A tier's stream (content events, a usage event, [DONE]) cut into arbitrary reads."""
    deltas = draw(st.lists(TEXT, min_size=1, max_size=8))
    head = {"id": "c", "object": "chat.completion.chunk", "model": "m"}
    events = [event(head | {"choices": [{"index": 0, "delta": {"content": d}}]}) for d in deltas]
    events.append(event(head | {"choices": [], "usage": USAGE}))
    events.append(b"data: [DONE]\n\n")
    whole = b"".join(events)
    cuts = sorted(draw(st.sets(st.integers(1, len(whole) - 1), max_size=12)))
    reads = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
    return events, reads


class FakeUpstream(SimpleNamespace):
    def add_in_flight(self, n: int) -> None:
        self.in_flight += n


async def relayed(reads: list[bytes], strip_usage: bool) -> tuple[bytes, RequestRecord]:
    async def chunks():
        for read in reads[1:]:
            yield read

    # A vllm tier: its `reasoning` key would be renamed, but never a delta's text.
    upstream = FakeUpstream(in_flight=1, tier="full", config=SimpleNamespace(engine="vllm"))
    result = Attempt(upstream, httpx.Response(200), chunks(), first_chunk=reads[0])  # type: ignore[arg-type]
    decision = Decision("full", None, "model", "override")
    record = RequestRecord("r", "/chat/completions", decision, GatewayMetrics({}))
    deadline = asyncio.get_running_loop().time() + 60
    out = [piece async for piece in relay(result, record, strip_usage, deadline)]
    assert all(piece.endswith(b"\n\n") for piece in out)  # whole events only
    assert upstream.in_flight == 0
    return b"".join(out), record


@given(streams(), st.booleans())
@settings(max_examples=200, deadline=None)
def test_relay_passes_whole_events_however_the_bytes_are_cut(stream, strip_usage):
    events, reads = stream
    out, record = asyncio.run(relayed(reads, strip_usage))
    expected = events[:-2] + events[-1:] if strip_usage else events
    assert out == b"".join(expected)
    assert record.usage == USAGE
