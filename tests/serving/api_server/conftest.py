"""The engine the tier server's app tests run over: a random-weight MoE checkpoint."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.engine.async_engine import AsyncEngine
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.tokenizer import Tokenizer
from tests.serving.api_server.tier_app import MAX_MODEL_LEN


@pytest.fixture(scope="module")
def aengine(random_checkpoint: Path) -> Iterator[AsyncEngine]:
    config = EngineConfig(kv_cache_bytes=8 << 20, max_model_len=MAX_MODEL_LEN)
    engine = AsyncEngine(LLMEngine.from_checkpoint(random_checkpoint, config))
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def tokenizer(random_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(random_checkpoint)
