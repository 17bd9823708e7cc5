"""A checkpoint's generation_config.json sets the sampling fields a request leaves unset, as
vLLM's `--generation-config auto`; `vllm` ignores the file; a request's own value wins."""

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serving.api_server.api_server import build_app
from serving.api_server.protocol import ChatCompletionRequest, CompletionRequest
from serving.cli import main
from serving.engine.async_engine import AsyncEngine
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import sampling_defaults
from serving.model.config import CheckpointError

RECOMMENDED = {"temperature": 0.0, "top_p": 0.8, "top_k": 20}
USER = [{"role": "user", "content": "What is 17 * 23?"}]


@pytest.fixture(scope="module")
def greedy_checkpoint(random_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random checkpoint whose creator recommends greedy decoding."""
    path = tmp_path_factory.mktemp("greedy") / "greedy-moe"
    shutil.copytree(random_checkpoint, path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(gen | RECOMMENDED))
    return path


def test_auto_reads_the_recommended_fields_and_vllm_ignores_them(greedy_checkpoint: Path) -> None:
    assert sampling_defaults(greedy_checkpoint, "auto") == RECOMMENDED
    assert sampling_defaults(greedy_checkpoint, "vllm") == {}


def test_a_malformed_field_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(CheckpointError, match="temperature must be a number"):
        sampling_defaults(tmp_path, "auto")


@pytest.mark.parametrize("request_type", [ChatCompletionRequest, CompletionRequest])
def test_unset_fields_inherit_and_set_ones_win(request_type: type) -> None:
    body = {"messages": USER} if request_type is ChatCompletionRequest else {"prompt": "17 * 23"}
    inherited = request_type(**body).to_sampling_params(16, RECOMMENDED)
    assert (inherited.temperature, inherited.top_p, inherited.top_k) == (0.0, 0.8, 20)
    explicit = request_type(**body, temperature=0.7, top_k=-1).to_sampling_params(16, RECOMMENDED)
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (0.7, 0.8, -1)
    neutral = request_type(**body).to_sampling_params(16, {})
    assert (neutral.temperature, neutral.top_p, neutral.top_k) == (1.0, 1.0, 0)


@pytest.fixture(scope="module")
def engine(greedy_checkpoint: Path) -> Iterator[AsyncEngine]:
    config = EngineConfig(kv_cache_bytes=8 << 20, max_model_len=256)
    aengine = AsyncEngine(LLMEngine.from_checkpoint(greedy_checkpoint, config))
    yield aengine
    aengine.stop()


async def _texts(engine: AsyncEngine, checkpoint: Path, mode: str, **fields: float) -> list[str]:
    """The replies to the same request under four seeds, served with `mode`'s defaults."""
    assert engine.engine.tokenizer is not None
    defaults = sampling_defaults(checkpoint, mode)
    app = build_app(engine, engine.engine.tokenizer, "m", sampling_defaults=defaults)
    transport = httpx.ASGITransport(app)
    texts = []
    async with httpx.AsyncClient(transport=transport, base_url="http://tier") as client:
        for seed in range(4):
            body = {"messages": USER, "max_tokens": 12, "seed": seed, "ignore_eos": True}
            response = await client.post("/v1/chat/completions", json=body | fields)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["message"]["content"])
    return texts


async def test_served_requests_without_temperature_decode_greedily(
    engine: AsyncEngine, greedy_checkpoint: Path
) -> None:
    greedy = await _texts(engine, greedy_checkpoint, "auto", temperature=0.0)
    assert len(set(greedy)) == 1
    assert await _texts(engine, greedy_checkpoint, "auto") == greedy  # the checkpoint's 0
    # An explicit temperature wins; vllm mode samples at 1.0 (a random model: seeds differ).
    sampled = await _texts(engine, greedy_checkpoint, "auto", temperature=1.0, top_k=0)
    assert len(set(sampled)) > 1
    assert len(set(await _texts(engine, greedy_checkpoint, "vllm"))) > 1


def test_generate_applies_the_generation_config(
    greedy_checkpoint: Path, capsys: pytest.CaptureFixture
) -> None:
    # One prompt a run: compiling decode steps would only cost time.
    args = ["generate", "--enforce-eager", "--model", str(greedy_checkpoint), "--max-tokens", "8"]
    args += ["--chat", "Hi"]
    outputs = []
    for extra in ([], [], ["--generation-config", "vllm"], ["--generation-config", "vllm"]):
        main([*args, *extra])
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]  # greedy from the checkpoint's temperature 0
    assert outputs[2] != outputs[3]  # vllm: temperature 1.0, unseeded
    main([*args, "--temperature", "0"])
    assert capsys.readouterr().out == outputs[0]
