"""A real vLLM behind the gateway: `tierserve serve` with a `vllm` full tier (vLLM's OpenAI
server on `models/demo-full`, started and supervised by the gateway) and the embedded highspeed
tier, checked with the official `openai` client.

Left out of the default run (pyproject's `-m 'not vllm'`): installing vLLM takes about 45
minutes, beyond CI's budget, and it starts in 1-2 minutes on a 2-core machine. Run it with

    python -m pytest -m vllm

against the interpreter of a vLLM environment named by `TIERSERVE_VLLM_PYTHON` (default
`.venv-vllm/bin/python`; docs/deploying.md says how to make one). Without one it fails, not
skips: a vLLM test asked for by name that passes by skipping would say vLLM works when nothing
was tried.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from serving.gateway.config import VllmTier
from serving.gateway.upstream import free_port
from serving.gateway.vllm_tier import vllm_command
from tests.serving.gateway.processes import Gateway, process_group

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("TIERSERVE_VLLM_PYTHON", ".venv-vllm/bin/python"))
STARTUP_S = 600  # vLLM's start (1-2 min alone) next to the embedded tier's on 2 cores
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
QUESTION = [{"role": "user", "content": "What is 17 * 23?"}]


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    python = VLLM_PYTHON if VLLM_PYTHON.is_absolute() else ROOT / VLLM_PYTHON
    if not python.is_file():
        pytest.fail(
            f"no vLLM interpreter at {python}: set TIERSERVE_VLLM_PYTHON to the python of a "
            "vLLM environment (docs/deploying.md#a-vllm-environment)"
        )
    return python


@pytest.fixture(scope="module")
def gateway(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    directory = tmp_path_factory.mktemp("vllm-gateway")
    port = free_port()
    full = {
        "engine": "vllm",
        "python": str(vllm_python),
        "model": str(ROOT / "models/demo-full"),
        "dtype": "bfloat16",
        "max_model_len": 2048,
        "cpu_kv_cache_space_gib": 1,
    }
    highspeed = {"model": str(ROOT / "models/demo-highspeed"), "enforce_eager": True}
    config = {
        "port": port,
        "tiers": {"full": full, "highspeed": highspeed},
        "router": {"policy": "heuristic"},
        "supervisor": {"health_interval_s": 0.5, "restart_backoff_s": 0.5},
        "limits": {"tier_ready_wait_s": 5},
    }
    path = directory / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (directory / "serve.log").open("w")
    command = [sys.executable, "-c", "from serving.cli import main; main()", "serve"]
    process = subprocess.Popen([*command, "--config", str(path)], stdout=log, stderr=log)
    gw = Gateway(process, f"http://127.0.0.1:{port}")
    groups: set[int] = set()
    try:
        began = time.monotonic()
        health = gw.wait_healthy(timeout_s=STARTUP_S)
        print(f"gateway ready in {time.monotonic() - began:.0f} s: {json.dumps(health['tiers'])}")
        groups |= {t["pid"] for t in health["tiers"].values()}
        yield gw
        groups |= {t["pid"] for t in gw.health()["tiers"].values() if t.get("pid")}
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=120)
        left = [pid for pgid in groups for pid in process_group(pgid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        lines = (directory / "serve.log").read_text(errors="replace").splitlines()
        print("\n".join(line for line in lines if '"logger": "serving.gateway' in line))
        assert not left, f"tier processes outlived the gateway: {left}"


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> OpenAI:
    return OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _reasoning(message: object) -> str | None:
    """The reasoning split off the answer: vLLM 0.32 calls it `reasoning`, the gateway (as
    `tierserve engine`) `reasoning_content`, and renames vLLM's."""
    extra = getattr(message, "model_extra", None) or {}
    assert "reasoning" not in extra, extra
    return extra.get("reasoning_content")


def test_vllm_parses_the_command_line_the_gateway_builds(vllm_python: Path) -> None:
    """Every flag the gateway can pass, parsed and validated by the installed vLLM's own
    parser (its flags change between versions)."""
    tier = VllmTier.model_validate(
        {
            "engine": "vllm",
            "model": str(ROOT / "models/demo-full"),
            "dtype": "bfloat16",
            "max_model_len": 2048,
            "max_num_seqs": 8,
            "tensor_parallel_size": 2,
            "enable_expert_parallel": True,
            "gpu_memory_utilization": 0.5,
            "speculative_config": {"model": "models/demo-draft", "num_speculative_tokens": 3},
            "api_key": "sk-tier",
            "extra_args": ["--seed", "7"],
        }
    )
    parse = (
        "import json, sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "try:\n"
        "    from vllm.entrypoints.launchers import cli_args\n"
        "except ImportError:\n"
        "    from vllm.entrypoints.openai import cli_args\n"
        "args = cli_args.make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
        "cli_args.validate_parsed_serve_args(args)\n"
        "print(json.dumps(vars(args), default=str))\n"
    )
    argv = vllm_command(tier, 8123)[3:]  # after `python -m vllm.entrypoints.openai.api_server`
    done = subprocess.run(
        [str(vllm_python), "-c", parse, *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    args = json.loads(done.stdout.strip().splitlines()[-1])
    assert args["served_model_name"] == ["demo-full"] and args["port"] == 8123
    assert (args["dtype"], args["max_model_len"], args["max_num_seqs"]) == ("bfloat16", 2048, 8)
    assert args["tensor_parallel_size"] == 2 and args["enable_expert_parallel"] is True
    assert args["gpu_memory_utilization"] == 0.5 and args["seed"] == 7
    assert "num_speculative_tokens" in str(args["speculative_config"])
    assert (args["tool_call_parser"], args["reasoning_parser"]) == ("hermes", "qwen3")
    assert args["enable_auto_tool_choice"] is True and args["api_key"] == ["sk-tier"]


def test_a_chat_on_the_vllm_tier(client: OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="full", messages=QUESTION, max_tokens=512, temperature=0
    )
    answer = raw.parse()
    assert raw.headers["x-tierserve-tier"] == "full"
    message = answer.choices[0].message
    assert "391" in (message.content or ""), message
    reasoning = _reasoning(message)
    assert reasoning and "17" in reasoning and "<think>" not in (message.content or "")
    assert answer.model == "demo-full"  # vLLM's served model name, passed through


def test_a_stream_from_the_vllm_tier(client: OpenAI) -> None:
    content, reasoning, chunks = [], [], 0
    stream = client.chat.completions.create(
        model="full", messages=QUESTION, max_tokens=512, temperature=0, stream=True
    )
    for chunk in stream:
        chunks += 1
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            reasoning.append(_reasoning(choice.delta) or "")
    assert chunks > 10, chunks  # token by token, not one whole answer
    assert "391" in "".join(content) and "".join(reasoning)


def test_a_tool_call_from_the_vllm_tier(client: OpenAI) -> None:
    answer = client.chat.completions.create(
        model="full",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        max_tokens=256,
        temperature=0,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_the_gateway_metrics_carry_the_vllm_tiers(gateway: Gateway, client: OpenAI) -> None:
    client.chat.completions.create(model="full", messages=QUESTION, max_tokens=64)
    text = httpx.get(gateway.url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    vllm = [name for name in families if name.startswith("vllm:")]
    assert len(vllm) > 10, sorted(families)
    tokens = families["vllm:generation_tokens"].samples
    assert {s.labels["tier"] for s in tokens} == {"full"}
    assert sum(s.value for s in tokens if s.name.endswith("_total")) > 0
    assert "vllm:num_requests_running" in families and "vllm:time_to_first_token_seconds" in vllm
    assert "tierserve_gateway_requests" in families  # the gateway's own, beside them


def test_a_killed_vllm_tier_fails_over_and_is_restarted(gateway: Gateway, client: OpenAI) -> None:
    pid = gateway.health()["tiers"]["full"]["pid"]
    assert len(process_group(pid)) >= 2  # vLLM's server and its engine process
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model="full", messages=QUESTION, max_tokens=32
    )
    assert raw.http_response.status_code == 200
    assert raw.headers["x-tierserve-tier"] == "highspeed"
    assert raw.headers["x-tierserve-reason"] in ("tier_down", "fallback")
    deadline = killed + STARTUP_S
    while (full := gateway.health()["tiers"]["full"])["state"] != "healthy" or full["pid"] == pid:
        assert time.monotonic() < deadline, f"not restarted: {full}"
        time.sleep(1)
    print(f"vLLM tier restarted and ready {time.monotonic() - killed:.0f} s after SIGKILL")
    assert full["restarts"] == 1 and not process_group(pid)  # its engine process went with it
    answer = client.chat.completions.with_raw_response.create(
        model="full", messages=QUESTION, max_tokens=512, temperature=0
    )
    assert answer.headers["x-tierserve-tier"] == "full"
    assert "391" in (answer.parse().choices[0].message.content or "")
