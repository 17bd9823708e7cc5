"""The supervision of `vllm` tiers, in the default run: `tierserve serve` with two vllm tiers
whose "vLLM" is a stub module (`python -m vllm.entrypoints.openai.api_server` from a directory
on the child's PYTHONPATH), so the gateway's own part is tested in seconds: it starts the
child with its command line and environment, waits for its /health, routes to it, scrapes its
`vllm:` metrics, restarts it when it is killed (with the rest of its process group) and fails
over meanwhile. `test_vllm_tier.py` does the same with the real vLLM."""

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
from prometheus_client.parser import text_string_to_metric_families

from serving.gateway.upstream import free_port
from tests.serving.gateway.processes import Gateway, alive, process_group

STUB = '''\
"""A stand-in for vLLM's OpenAI server: its flags, /health, /metrics and a chat answer."""
import argparse, json, os, subprocess, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("--served-model-name")
args, _ = parser.parse_known_args()
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "pid": os.getpid(), "env": {
        k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "PYTHONPATH")}}) + "\\n")
# vLLM runs its engine in a second process: so does the stub.
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
served = 0


class Handler(BaseHTTPRequestHandler):
    def _send(self, status, body, kind="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            return self._send(200, b"")
        metrics = (
            "# HELP vllm:request_success_total Finished requests.\\n"
            "# TYPE vllm:request_success_total counter\\n"
            f'vllm:request_success_total{{model_name="{args.served_model_name}"}} {served}\\n'
            "# HELP process_open_fds Open file descriptors.\\n"
            "# TYPE process_open_fds gauge\\n"
            "process_open_fds 7.0\\n"
        )
        self._send(200, metrics.encode(), "text/plain; version=0.0.4")

    def do_POST(self):
        global served
        self.rfile.read(int(self.headers["Content-Length"]))
        served += 1
        message = {"role": "assistant", "content": f"pid {os.getpid()}", "reasoning": "r"}
        body = {"id": "c", "object": "chat.completion", "created": 1,
                "model": args.served_model_name, "choices": [
                    {"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
        self._send(200, json.dumps(body).encode())

    def log_message(self, *_):
        pass


ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
'''


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Path]]:
    directory = tmp_path_factory.mktemp("vllm-stub")
    package = directory / "stub" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for level in (package, *package.parents):
        if level == directory / "stub":
            break
        (level / "__init__.py").touch()
    (package / "api_server.py").write_text(STUB)
    checkpoint = directory / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    log = directory / "stub.log"
    env = {"PYTHONPATH": str(directory / "stub"), "STUB_LOG": str(log)}
    tier = {"engine": "vllm", "python": sys.executable, "model": str(checkpoint), "env": env}
    port = free_port()
    config = {
        "port": port,
        "tiers": {
            "full": tier | {"served_model_name": "stub-full", "cpu_kv_cache_space_gib": 1},
            "highspeed": tier | {"served_model_name": "stub-fast"},
        },
        "router": {"policy": "heuristic"},
        "supervisor": {"health_interval_s": 0.5, "restart_backoff_s": 0.5},
    }
    path = directory / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-c", "from serving.cli import main; main()", "serve"]
    with (directory / "serve.log").open("w") as out:
        process = subprocess.Popen([*command, "--config", str(path)], stdout=out, stderr=out)
    gw = Gateway(process, f"http://127.0.0.1:{port}")
    try:
        gw.wait_healthy(timeout_s=60)
        yield gw, log
    finally:
        process.terminate()
        process.wait(timeout=60)


def _started(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _chat(gw: Gateway, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)


def test_the_child_gets_its_flags_and_environment(gateway) -> None:
    gw, log = gateway
    full = next(s for s in _started(log) if "stub-full" in s["argv"])
    argv = full["argv"]
    assert argv[argv.index("--model") + 1].endswith("ckpt")
    assert f":{argv[argv.index('--port') + 1]}/" in gw.health()["tiers"]["full"]["url"]
    assert {"--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser"} <= set(argv)
    assert full["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert full["env"]["PYTHONPATH"].endswith("stub")  # the tier's, not the gateway's


def test_requests_reach_the_vllm_tier(gateway) -> None:
    gw, _ = gateway
    response = _chat(gw, "full")
    assert response.status_code == 200, response.text
    assert response.headers["x-tierserve-tier"] == "full"
    assert response.json()["choices"][0]["message"]["reasoning_content"] == "r"  # renamed
    assert gw.health()["tiers"]["full"]["engine"] == "vllm"


def test_the_gateway_metrics_carry_the_vllm_tiers(gateway) -> None:
    gw, _ = gateway
    _chat(gw, "full")
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = families["vllm:request_success"].samples
    totals = {s.labels["tier"]: s for s in samples if s.name.endswith("_total")}
    assert set(totals) == {"full", "highspeed"} and totals["full"].value >= 1
    assert totals["full"].labels["model_name"] == "stub-full"
    assert "process_open_fds" not in families  # the child's process metrics are not the gateway's
    assert "tierserve_gateway_requests" in families


def test_a_killed_vllm_tier_fails_over_and_restarts_without_orphans(gateway) -> None:
    gw, log = gateway
    pid = gw.health()["tiers"]["full"]["pid"]
    engines = [p for p in process_group(pid) if p != pid]
    assert engines, "the stub's engine process"
    os.kill(pid, signal.SIGKILL)
    response = _chat(gw, "full")
    assert response.status_code == 200
    assert response.headers["x-tierserve-tier"] == "highspeed"
    deadline = time.monotonic() + 30
    while (full := gw.health()["tiers"]["full"])["state"] != "healthy" or full["pid"] == pid:
        assert time.monotonic() < deadline, full
        time.sleep(0.2)
    assert full["restarts"] == 1
    assert not any(alive(p) for p in engines), "the killed server's engine outlived it"
    assert _chat(gw, "full").headers["x-tierserve-tier"] == "full"
    assert sum("stub-full" in s["argv"] for s in _started(log)) == 2
