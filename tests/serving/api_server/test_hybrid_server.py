"""The tier server over a hybrid (Qwen3-Next) checkpoint, as the official `openai` client sees
it (over ASGI): what `tierserve engine --model DIR` serves for that family."""

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi import FastAPI

from serving.api_server.api_server import build_app
from serving.engine.async_engine import AsyncEngine
from serving.engine.llm_engine import EngineConfig, LLMEngine
from tests.serving.api_server.tier_app import USER, asgi_client
from tests.serving.model.hybrid_tiny import write_served_hybrid_checkpoint

pytest.importorskip("transformers")  # writes the checkpoint

MODEL = "tiny-hybrid"


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastAPI]:
    path: Path = tmp_path_factory.mktemp(MODEL)
    write_served_hybrid_checkpoint(path)
    engine = AsyncEngine(LLMEngine.from_checkpoint(path, EngineConfig(kv_cache_bytes=1 << 20)))
    yield build_app(engine, engine.engine.tokenizer, MODEL)
    engine.stop()


async def test_chat_whole_streamed_and_n(app: FastAPI) -> None:
    client = openai.AsyncOpenAI(
        base_url="http://tier/v1", api_key="unused", http_client=asgi_client(app), max_retries=0
    )
    kwargs = {"model": MODEL, "messages": USER, "max_tokens": 6, "temperature": 0}
    whole = await client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    [choice] = whole.choices
    assert whole.model == MODEL and whole.usage.completion_tokens == 6
    assert choice.finish_reason == "length" and choice.message.content
    stream = await client.chat.completions.create(
        **kwargs, stream=True, extra_body={"ignore_eos": True}
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == choice.message.content
    both = await client.chat.completions.create(**kwargs, n=2, extra_body={"ignore_eos": True})
    assert [c.message.content for c in both.choices] == [choice.message.content] * 2
