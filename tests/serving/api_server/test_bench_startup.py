"""The start-up benchmark's reference: the measured server and every process below it (its
compile process, that process's compilers) stand still while the reference serves."""

import contextlib
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from loadtests import bench_startup
from loadtests.bench_startup import process_tree, stopped
from tests.serving.gateway.processes import settles, state


def test_a_server_and_its_descendants_stop_and_continue_together(tmp_path: Path):
    pids = tmp_path / "pids"
    script = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import subprocess, time; "
        'subprocess.Popen(["sleep", "60"]); time.sleep(60)\'], process_group=0)\n'
        f"open({str(pids)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    server = subprocess.Popen([sys.executable, "-c", script])

    def tree() -> list[int]:
        return [p.pid for p in process_tree(server.pid)]

    try:
        assert settles(lambda: pids.exists() and len(tree()) == 3)
        pids_below = tree()
        assert pids_below[0] == server.pid and int(pids.read_text()) in pids_below
        with stopped(server.pid):
            assert all(state(pid) == "T" for pid in pids_below)
        assert settles(lambda: all(state(pid) != "T" for pid in pids_below))
    finally:
        for p in reversed(process_tree(server.pid)):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        server.wait()


def test_a_process_that_never_reports_stopped_fails_the_bench_by_name(monkeypatch):
    """Were SIGSTOP never to take (here it is not sent), the bench fails, naming the process,
    instead of waiting for it for ever."""
    monkeypatch.setattr(psutil.Process, "suspend", lambda self: None)
    monkeypatch.setattr(bench_startup, "STOP_TIMEOUT_S", 0.2)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        failure = pytest.raises(RuntimeError, match=f"process {sleeper.pid} was sent SIGSTOP")
        with failure, stopped(sleeper.pid):
            pass
    finally:
        sleeper.kill()
        sleeper.wait()
