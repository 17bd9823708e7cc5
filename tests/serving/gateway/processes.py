"""A real `tierserve serve` process over two embedded tiers (random-weight checkpoints), for
the end-to-end and fault tests."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

from serving.gateway.upstream import free_port

NAMES = {"full": "tiny-full", "highspeed": "tiny-fast"}


def state(pid: int) -> str:
    """A process's state letter in /proc: R, S, D, T (stopped), Z (exited, not reaped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]


def settles(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether `condition` holds within `timeout_s` (a signal, a process's exit take a
    moment)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is gone for our purposes.
    return state(pid) != "Z"


def process_group(pgid: int) -> list[int]:
    """The live processes of a process group (a tier's server and, for vLLM, its engine)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid and alive(int(entry.name)):
                    pids.append(int(entry.name))
            except (ProcessLookupError, FileNotFoundError):
                pass
    return pids


class Gateway:
    def __init__(self, process: subprocess.Popen, url: str) -> None:
        self.process = process
        self.url = url

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def wait_healthy(self, timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, "tierserve serve exited"
            assert time.monotonic() < deadline, f"tiers not ready after {timeout_s:g} s"
            try:
                health = self.health()
                if health["status"] == "ok":
                    return health
            except httpx.HTTPError:
                pass
            time.sleep(0.2)


def start_gateway(
    checkpoint: Path,
    directory: Path,
    ports: dict[str, int] | None = None,
    enforce_eager: bool = True,
    max_model_len: int = 256,
) -> Gateway:
    """`tierserve serve` over two embedded tiers of `checkpoint`, ready; `ports` may fix
    the gateway's (`gateway`) and the tiers' ports (by tier), else they are free ones. Tiers
    run eagerly unless told otherwise: compiling in the background would slow other tests."""
    ports = ports or {}
    tier = {"model": str(checkpoint), "max_model_len": max_model_len, "kv_cache_memory_mib": 8}
    tier["enforce_eager"] = enforce_eager
    port = ports.get("gateway") or free_port()
    config = {
        "port": port,
        "tiers": {
            t: tier | {"served_model_name": name, "port": ports.get(t)} for t, name in NAMES.items()
        },
        "router": {"policy": "heuristic"},
        "supervisor": {"health_interval_s": 0.5, "restart_backoff_s": 0.5},
        "drain_timeout_s": 20,
    }
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-c", "from serving.cli import main; main()", "serve"]
    log = (directory / "serve.log").open("w")
    process = subprocess.Popen([*command, "--config", str(path)], stderr=log, stdout=log)
    gw = Gateway(process, f"http://127.0.0.1:{port}")
    # Ready means compiled: minutes with an empty compile cache on a busy 2-core machine.
    gw.wait_healthy(timeout_s=120 if enforce_eager else 900)
    return gw


def stop(gw: Gateway, pids: list[int]) -> None:
    if gw.process.poll() is None:
        gw.process.terminate()
        gw.process.wait(timeout=60)
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def child_pids(gw: Gateway) -> list[int]:
    if gw.process.poll() is not None:
        return []
    try:
        tiers = gw.health()["tiers"].values()
        return [pid for t in tiers for pid in (t["pid"], t.get("standby_pid")) if pid]
    except httpx.HTTPError:
        return []
