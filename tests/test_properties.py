"""Property tests (hypothesis): the gateway's SSE relay and the chat template.

- Relay: whatever events a tier sends and however the bytes are cut into reads, the client
  gets exactly the events, whole and in order, minus only the usage event the gateway asked
  for (whose usage is still counted).
- Chat template: for any conversation (any text, reasoning, tool calls, system prompts), our
  rendering is transformers' `apply_chat_template` of the same template, character for
  character.
"""

import asyncio
import functools
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.policy import Decision
from serving.gateway_metrics import GatewayMetrics
from serving.gateway_proxy import Attempt, RequestRecord, relay
from serving.tokenizer import Tokenizer

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


async def relayed(reads: list[bytes], strip_usage: bool) -> tuple[bytes, RequestRecord]:
    async def chunks():
        for read in reads[1:]:
            yield read

    upstream = SimpleNamespace(in_flight=1, tier="full")
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


transformers = pytest.importorskip("transformers")

MESSAGE_TEXT = st.text(st.characters(exclude_categories=("Cs", "Cc")), max_size=30)
TOOL_CALL = st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "add"]), "arguments": st.dictionaries(
        st.sampled_from(["city", "a", "b"]), st.one_of(st.integers(), MESSAGE_TEXT), max_size=2)}
)  # fmt: skip


@st.composite
def conversations(draw: st.DrawFn) -> list[dict]:
    chat: list[dict] = []
    if draw(st.booleans()):
        chat.append({"role": "system", "content": draw(MESSAGE_TEXT)})
    for _ in range(draw(st.integers(1, 3))):
        chat.append({"role": "user", "content": draw(MESSAGE_TEXT)})
        reply: dict = {"role": "assistant", "content": draw(MESSAGE_TEXT)}
        if draw(st.booleans()):
            reply["reasoning_content"] = draw(MESSAGE_TEXT)
        calls = draw(st.lists(TOOL_CALL, max_size=2))
        if calls:
            reply["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            chat.append(reply)
            chat.append({"role": "tool", "content": draw(MESSAGE_TEXT)})
        else:
            chat.append(reply)
    if draw(st.booleans()):
        chat.pop()  # end on the user's (or a tool's) turn
    return chat


@functools.cache
def tokenizers(path: Path) -> tuple[Tokenizer, object]:
    """Ours and transformers' tokenizer of one checkpoint, loaded once."""
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)


@given(chat=conversations(), add_generation_prompt=st.booleans())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_chat_template_renders_as_transformers(
    random_checkpoint: Path, chat: list[dict], add_generation_prompt: bool
):
    ours, theirs = tokenizers(random_checkpoint)
    kwargs = {"add_generation_prompt": add_generation_prompt}
    expected = theirs.apply_chat_template(chat, tokenize=False, **kwargs)  # type: ignore[attr-defined]
    assert ours.apply_chat_template(chat, **kwargs) == expected
