"""A speculating tier server: per-request metrics beside usage (vLLM's shape), Prometheus
counters, and `--speculative-config` on the command line."""

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.api_server.api_server import build_app
from serving.engine.async_engine import AsyncEngine
from serving.engine.llm_engine import EngineConfig, LLMEngine
from speculative.config import SpeculativeConfig
from tests import REPO

TARGET = REPO / "models" / "demo-highspeed"
MESSAGES = [{"role": "user", "content": "Run `ls /tmp` and then `ls /tmp` again."}]


@pytest.fixture(scope="module")
def aengine() -> Iterator[AsyncEngine]:
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=3)
    engine = AsyncEngine(LLMEngine.from_checkpoint(TARGET, EngineConfig(speculative=spec)))
    yield engine
    engine.stop()


@pytest.fixture
async def client(aengine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(aengine, aengine.engine.tokenizer, "hs")
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tier") as c:
        yield c


def _check(spec: dict, completion_tokens: int) -> None:
    assert spec["num_spec_tokens"] == 3
    steps, drafted, accepted = (
        spec["num_spec_steps"],
        spec["num_draft_tokens"],
        spec["num_accepted_draft_tokens"],
    )
    assert steps > 0 and 0 < drafted <= 3 * steps and 0 <= accepted <= drafted
    assert sum(spec["acceptance_histogram"]) == steps
    assert spec["draft_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    # Every verification step emits its accepted drafts and one more token.
    assert steps + accepted <= completion_tokens


async def test_responses_carry_speculative_metrics(client):
    body = {"model": "hs", "messages": MESSAGES, "max_tokens": 40, "temperature": 0}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    _check(data["metrics"]["speculative_decoding"], data["usage"]["completion_tokens"])

    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    r = await client.post("/v1/chat/completions", json=stream)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:].startswith("{")]
    last = chunks[-1]
    assert "metrics" not in chunks[0]
    _check(last["metrics"]["speculative_decoding"], last["usage"]["completion_tokens"])
    # The same greedy text, streamed or not.
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    assert streamed == data["choices"][0]["message"]["content"]

    r = await client.post(
        "/v1/completions",
        json={"model": "hs", "prompt": ["ls ls ls ls", "cat a cat a"], "max_tokens": 30},
    )
    data = r.json()
    _check(data["metrics"]["speculative_decoding"], data["usage"]["completion_tokens"])


async def test_prometheus_counters(client):
    await client.post(
        "/v1/completions", json={"model": "hs", "prompt": "ls ls ls", "max_tokens": 20}
    )
    text = (await client.get("/metrics")).text
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("tierserve_spec_decode")
    }
    drafted = samples[("tierserve_spec_decode_num_draft_tokens_total", None)]
    accepted = samples[("tierserve_spec_decode_num_accepted_tokens_total", None)]
    assert samples[("tierserve_spec_decode_num_drafts_total", None)] > 0
    assert 0 < accepted <= drafted
    per_position = [v for (name, pos), v in sorted(samples.items(), key=str) if pos is not None]
    assert sum(per_position) == accepted


def test_command_line_rejects_a_bad_speculative_config():
    cli = [sys.executable, "-c", "from serving.cli import main; main()"]
    bad = '{"method": "ngram", "num_speculative_tokens": 0}'
    result = subprocess.run(
        [*cli, "engine", "--model", str(TARGET), "--speculative-config", bad],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "num_speculative_tokens" in result.stderr


def test_engine_without_speculation_has_no_metrics_field():
    from serving.api_server.responses import CompletionResponse, UsageInfo

    response = CompletionResponse(id="x", model="m", choices=[], usage=UsageInfo())
    assert "metrics" not in response.model_dump()


def test_gateway_tier_config_passes_speculation_to_the_engine():
    from serving.gateway.config import EmbeddedTier
    from serving.gateway.supervisor import engine_command

    tier = EmbeddedTier.model_validate(
        {
            "model": str(TARGET),
            "speculative": {"method": "deepseek_mtp", "num_speculative_tokens": 2},
        }
    )
    command = engine_command(tier, 8123)
    flag = command.index("--speculative-config")
    parsed = SpeculativeConfig.model_validate_json(command[flag + 1])
    assert parsed == SpeculativeConfig(method="mtp", num_speculative_tokens=2)
    with pytest.raises(ValueError):
        EmbeddedTier.model_validate({"model": "m", "speculative": {"method": "draft"}})
