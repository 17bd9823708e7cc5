"""A `vllm` tier's config becomes vLLM's command line and environment flag for flag, a wrong
config is refused by name before anything starts, the gateway's /metrics carries a vllm
tier's engine metrics relabelled with its tier, and vLLM's `reasoning` field reaches clients
as the gateway's `reasoning_content`. No vLLM needed (`test_vllm_tier.py` runs the
real one)."""

import json
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.gateway.config import (
    GatewayConfig,
    GatewayConfigError,
    VllmTier,
    check_checkpoints,
    load_config,
)
from serving.gateway.metrics import relabeled
from serving.gateway.supervisor import child_process
from tests.serving.gateway.scripted_tiers import chat_json, stream_of

SPECULATIVE = {"model": "models/demo-draft", "num_speculative_tokens": 3}


def _vllm(**fields) -> VllmTier:
    return VllmTier.model_validate({"engine": "vllm", "model": "models/demo-full"} | fields)


def test_every_field_reaches_the_command_line() -> None:
    tier = _vllm(
        python="/opt/vllm/bin/python",
        served_model_name="full-vllm",
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=64,
        tensor_parallel_size=4,
        enable_expert_parallel=True,
        gpu_memory_utilization=0.45,
        speculative_config=SPECULATIVE,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        api_key="sk-tier",
        extra_args=["--enforce-eager", "--seed", "7"],
    )
    command, _ = child_process(tier, 8123)
    assert command == [
        "/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "models/demo-full", "--host", "127.0.0.1", "--port", "8123",
        "--served-model-name", "full-vllm", "--dtype", "bfloat16",
        "--max-model-len", "2048", "--max-num-seqs", "64", "--tensor-parallel-size", "4",
        "--gpu-memory-utilization", "0.45",
        "--speculative-config", '{"model":"models/demo-draft","num_speculative_tokens":3}',
        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--api-key", "sk-tier",
        "--enable-auto-tool-choice", "--enable-expert-parallel",
        "--enforce-eager", "--seed", "7",
    ]  # fmt: skip
    assert json.loads(command[command.index("--speculative-config") + 1]) == SPECULATIVE


def test_defaults_are_the_checkpoints_parsers_and_nothing_else() -> None:
    command, _ = child_process(_vllm(), 8123)
    assert command[:3] == [".venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--served-model-name") + 1] == "demo-full"
    assert command[command.index("--dtype") + 1] == "auto"
    assert command[command.index("--tool-call-parser") + 1] == "hermes"
    assert command[command.index("--reasoning-parser") + 1] == "qwen3"
    assert "--enable-auto-tool-choice" in command
    for flag in ("--tensor-parallel-size", "--enable-expert-parallel", "--speculative-config",
                 "--max-model-len", "--api-key", "--gpu-memory-utilization"):  # fmt: skip
        assert flag not in command


def test_no_tool_parser_means_no_auto_tool_choice() -> None:
    command, _ = child_process(_vllm(tool_call_parser=None, reasoning_parser=None), 8123)
    assert not {"--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser"} & set(
        command
    )


def test_the_environment_is_the_tiers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/gateway/packages")
    monkeypatch.setenv("TIERSERVE_PROBE", "kept")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    tier = _vllm(cpu_kv_cache_space_gib=1, env={"CUDA_VISIBLE_DEVICES": "0,1"})
    _, env = child_process(tier, 8123)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["TIERSERVE_PROBE"] == "kept" and "PYTHONPATH" not in env
    assert "VLLM_CPU_KVCACHE_SPACE" not in child_process(_vllm(), 8123)[1]


def _write(tmp_path: Path, full: dict) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps({"tiers": {"full": full, "highspeed": {"model": "m-fast"}}}))
    return path


def test_a_vllm_tier_validates_and_serves_its_name(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, {"engine": "vllm", "model": "models/demo-full"}))
    assert isinstance(config.tiers.full, VllmTier)
    assert config.tiers.full.model_name == "demo-full"


VLLM = {"engine": "vllm", "model": "m"}
AT = r"tiers\.full\.vllm\."  # pydantic names the field with the tier kind it tried
WRONG = [
    (VLLM | {"tensor_parallel": 2}, AT + "tensor_parallel: Extra inputs are not permitted"),
    ({"engine": "vllm", "dtype": "bfloat16"}, AT + "model: Field required"),
    (VLLM | {"dtype": "fp8"}, AT + "dtype: Input should be 'auto'"),
    (VLLM | {"tensor_parallel_size": 0}, AT + "tensor_parallel_size: Input should be greater"),
    (VLLM | {"port": 8000}, r"distinct ports"),
]


@pytest.mark.parametrize("full,message", WRONG)
def test_a_wrong_vllm_tier_is_refused_by_name(tmp_path: Path, full: dict, message: str) -> None:
    with pytest.raises(GatewayConfigError, match=message):
        load_config(_write(tmp_path, full))


def test_a_missing_vllm_interpreter_or_checkpoint_stops_the_gateway(tmp_path: Path) -> None:
    def config(python: str, model: str) -> GatewayConfig:
        full = {"engine": "vllm", "python": python, "model": model}
        remote = {"engine": "remote", "base_url": "http://h:1/v1", "model": "fast"}
        return GatewayConfig.model_validate({"tiers": {"full": full, "highspeed": remote}})

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    with pytest.raises(GatewayConfigError, match=r"tiers\.full\.python: .* is not an executable"):
        check_checkpoints(config(str(tmp_path / "no-venv/bin/python"), str(checkpoint)))
    with pytest.raises(GatewayConfigError, match=r"tiers\.full\.model: .*\(no config\.json\)"):
        check_checkpoints(config(sys.executable, str(tmp_path)))
    check_checkpoints(config(sys.executable, str(checkpoint)))


VLLM_METRICS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="demo-full"} 2.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="demo-full"} 391.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="demo-full"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="demo-full"} 3.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="demo-full"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="demo-full"} 0.9
"""


def test_vllm_metrics_are_relabelled_with_their_tier() -> None:
    other = VLLM_METRICS.replace("demo-full", "demo-draft")
    text = relabeled({"full": VLLM_METRICS, "highspeed": other}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {
        "vllm:num_requests_running",
        "vllm:generation_tokens",
        "vllm:time_to_first_token_seconds",
    }  # the child's process metrics stay at /metrics/tiers/{tier}
    running = families["vllm:num_requests_running"].samples
    assert {(s.labels["tier"], s.labels["model_name"], s.value) for s in running} == {
        ("full", "demo-full", 2.0),
        ("highspeed", "demo-draft", 2.0),
    }
    ttft = families["vllm:time_to_first_token_seconds"]
    assert ttft.type == "histogram" and len(ttft.samples) == 8
    assert relabeled({}) == b""


def _vllm_answer(request: httpx.Request) -> httpx.Response:
    """A tier answering as vLLM 0.32 does: the reasoning in `reasoning`."""
    text = 'a "reasoning": key in text'  # escaped in the JSON: never renamed
    if json.loads(request.content).get("stream"):
        head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m-full"}
        deltas = [{"role": "assistant", "reasoning": "think"}, {"content": text}]
        events = [json.dumps(head | {"choices": [{"index": 0, "delta": d}]}) for d in deltas]
        chunks = [f"data: {e}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]
        return httpx.Response(200, content=stream_of(chunks))
    answer = chat_json("m-full", text)
    answer["choices"][0]["message"]["reasoning"] = "think"
    return httpx.Response(200, json=answer)


async def test_vllms_reasoning_field_is_the_gateways(tiers: dict, client) -> None:
    tiers["full"].handler = _vllm_answer
    body = {"model": "full", "messages": [{"role": "user", "content": "Hi"}]}
    message = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert message["message"]["reasoning_content"] == "think"
    assert "reasoning" not in message["message"]
    assert message["message"]["content"] == 'a "reasoning": key in text'
    response = await client.post("/v1/chat/completions", json=body | {"stream": True})
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line[6:7] == "{"]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["reasoning_content"] == "think" and "reasoning" not in deltas[0]
    assert deltas[1]["content"] == 'a "reasoning": key in text'
