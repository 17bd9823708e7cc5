"""`tierserve loadtest` end to end: Locust headless against a gateway that the command starts
itself (over canned tiers, so it takes seconds), a report with plots, and the exit status
that says whether the SLOs held."""

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from serving.gateway.loadtest import LoadTestError, wait_ready
from serving.gateway.upstream import free_port
from tests import REPO

pytestmark = pytest.mark.slow
CANNED = REPO / "loadtests" / "canned_tier.py"


def canned_tiers(directory: Path, warmup_s: float) -> tuple[Path, list[subprocess.Popen]]:
    """A gateway config over two canned tiers (processes, 2 ms per token) whose /health says
    they warm up for `warmup_s` after they start, as compiling tiers do."""
    tiers, processes = {}, []
    for tier in ("full", "highspeed"):
        port = free_port()
        command = [sys.executable, str(CANNED), "--port", str(port), "--token-delay-ms", "2"]
        processes.append(subprocess.Popen([*command, "--warmup-s", str(warmup_s)]))
        base_url = f"http://127.0.0.1:{port}/v1"
        tiers[tier] = {"engine": "remote", "base_url": base_url, "model": f"canned-{tier}"}
    path = directory / "gateway.yaml"
    path.write_text(yaml.safe_dump({"tiers": tiers, "router": {"policy": "heuristic"}}))
    return path, processes


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Tiers that warm up for 6 s: the first load test must wait for them, or its requests
    would wait at the gateway (up to 10 s, then 503) and miss its SLOs."""
    path, processes = canned_tiers(tmp_path_factory.mktemp("loadtest"), warmup_s=6)
    yield path
    for process in processes:
        process.terminate()
        process.wait(timeout=30)


def loadtest(config: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "from serving.cli import main; main()", "loadtest"]
    command += ["--config", str(config), "--users", "4", "--spawn-rate", "4", "--duration", "4"]
    command += ["--out", str(out), *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_loadtest_writes_a_report_and_passes_its_slos(config: Path, tmp_path: Path):
    result = loadtest(config, tmp_path, "--slo-ttft-p99-ms", "5000", "--slo-error-rate", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["requests"] > 0 and summary["failures"] == 0
    assert set(summary["requests_by_tier"]) == {"full", "highspeed"}
    assert set(summary["ttft_ms"]) == {"full", "highspeed"}  # streams report TTFT per tier
    assert (tmp_path / "report.png").stat().st_size > 10_000
    for name in ("locust_stats.csv", "locust_stats_history.csv", "locust_failures.csv"):
        assert (tmp_path / name).exists()
    report = (tmp_path / "report.md").read_text()
    assert "SLOs: all met" in report and "| full |" in report and "| highspeed |" in report


def test_a_missed_slo_exits_non_zero(config: Path, tmp_path: Path):
    result = loadtest(config, tmp_path, "--slo-ttft-p99-ms", "0.001")
    assert result.returncode == 1
    assert "SLO missed: p99 TTFT on" in result.stderr


def test_tiers_never_ready_fail_with_a_clear_message(tmp_path: Path):
    config, processes = canned_tiers(tmp_path, warmup_s=3600)
    try:
        result = loadtest(config, tmp_path / "out", "--ready-timeout", "10")
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
    assert result.returncode != 0
    assert "tiers not ready after 10 s (--ready-timeout)" in result.stderr, result.stderr
    assert "full warming 0/6" in result.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_server_that_exits_before_ready_names_its_status_and_its_last_lines(tmp_path: Path):
    """The log's end is in the error itself: a benchmark's log may not outlive its directory."""
    log = tmp_path / "serve.log"
    log.write_text("starting\ntierserve: error: --model: no config.json in /nowhere\n")
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"])
    process.wait()
    with pytest.raises(LoadTestError, match=r"status 2 (.|\n)*no config.json in /nowhere"):
        wait_ready(f"http://127.0.0.1:{free_port()}", 30, process, log)
