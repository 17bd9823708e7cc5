"""The sandbox: normal runs, then red-team runs that must be contained and reported."""

import json
import os
import resource
import shutil
import socket
import time
from pathlib import Path

import pytest

import training.tasks.sandbox.sandbox as sandbox_module
from serving.cli import main as cli_main
from tests import REPO
from training.tasks.sandbox import Limits, Sandbox, SandboxPool, run_code

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap (bwrap) is not installed; CI installs Debian's bubblewrap package",
)
FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


def _alive_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            pids.append(int(pid))
    return pids


def _assert_gone(marker: str) -> None:
    """Killed namespaces are torn down asynchronously: allow a short grace."""
    for _ in range(40):
        if not _alive_with(marker):
            return
        time.sleep(0.05)
    raise AssertionError(f"processes with {marker!r} outlived their run: {_alive_with(marker)}")


@needs_bwrap
def test_python_sees_stdin_files_and_a_scrubbed_env() -> None:
    source = "import os\nprint(open('data/in.txt').read(), input(), os.getcwd(), dict(os.environ))"
    result = run_code("python", source, {"data/in.txt": "from a file"}, stdin="from stdin\n")
    assert result.status == "ok" and result.exit_code == 0 and result.reason == "exit 0"
    assert result.isolation == "bubblewrap"
    assert "from a file from stdin /sandbox" in result.stdout
    assert "'HOME': '/sandbox'" in result.stdout
    assert json.loads(json.dumps(result.to_json()))["status"] == "ok"


@needs_bwrap
def test_files_persist_across_runs_and_tree_shows_them() -> None:
    with Sandbox({"a.txt": "one\n"}) as box:
        first = box.run("bash", "mkdir -p out && cat a.txt > out/b.txt && echo two >> out/b.txt")
        second = box.run("python", "print(open('out/b.txt').read().split())")
        assert first.status == second.status == "ok"
        assert second.stdout == "['one', 'two']\n"
        assert box.tree() == {"a.txt": "one\n", "out/b.txt": "one\ntwo\n"}
        root = box.root
    assert not root.exists()


@needs_bwrap
def test_error_exit_is_reported() -> None:
    result = run_code("python", "raise SystemExit('boom')")
    assert (result.status, result.exit_code, result.reason) == ("error", 1, "exit 1")
    assert "boom" in result.stderr


@needs_bwrap
def test_process_limit_stops_forking() -> None:
    source = """
import os, time
n = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    n += 1
print(n)
"""
    result = run_code("python", source, limits=Limits(processes=16))
    assert result.status == "ok"
    assert 0 < int(result.stdout) < 16


@needs_bwrap
def test_fork_bomb_is_contained_and_the_host_stays_responsive() -> None:
    result = run_code("python", FORK_BOMB + "# bomb-7f3a", limits=Limits(timeout_s=2))
    assert result.status == "timeout" and result.reason == "timed out after 2.0 s"
    assert result.duration_s < 3
    start = time.monotonic()
    after = run_code("python", "print('still here')")
    assert after.status == "ok" and after.stdout == "still here\n"
    assert time.monotonic() - start < 2
    _assert_gone("bomb-7f3a")


@needs_bwrap
def test_memory_bomb_fails_inside_the_limit() -> None:
    result = run_code("python", "x = bytearray(4 << 30)\nprint('allocated')")
    assert result.status == "error" and "allocated" not in result.stdout
    assert "MemoryError" in result.reason and "512 MB" in result.reason


@needs_bwrap
def test_infinite_loop_hits_the_cpu_limit() -> None:
    result = run_code("python", "while True: pass", limits=Limits(cpu_s=1, timeout_s=10))
    assert result.status == "killed" and "SIGXCPU" in result.reason
    assert result.duration_s < 4


@needs_bwrap
def test_sleep_past_the_timeout_is_killed_in_time_with_its_children() -> None:
    result = run_code("bash", "sleep 4242.5 &\nsleep 4242.5", limits=Limits(timeout_s=1))
    assert result.status == "timeout" and result.reason == "timed out after 1.0 s"
    assert 1.0 <= result.duration_s < 1.5
    _assert_gone("4242.5")


@needs_bwrap
def test_file_size_limit() -> None:
    with Sandbox(limits=Limits(file_size_mb=1)) as box:
        result = box.run("bash", "head -c 4000000 /dev/zero > big")
        assert result.status == "killed" and "SIGXFSZ" in result.reason
        assert (box.root / "big").stat().st_size <= 1 << 20


@needs_bwrap
def test_writes_outside_the_work_dir_fail(tmp_path: Path) -> None:
    canary = tmp_path / "canary.txt"
    canary.write_text("original")
    targets = [canary, tmp_path / "new.txt", REPO / "sandbox-escape.txt", "/etc/passwd", "/usr/x"]
    source = f"""
for path in {[str(t) for t in targets]!r}:
    try:
        with open(path, "a") as f:
            f.write("pwned")
        print("WROTE", path)
    except OSError as e:
        print("denied", path, type(e).__name__)
"""
    result = run_code("python", source)
    assert result.status == "ok" and "WROTE" not in result.stdout
    assert result.stdout.count("denied") == len(targets)
    assert canary.read_text() == "original"
    assert not (tmp_path / "new.txt").exists() and not (REPO / "sandbox-escape.txt").exists()
    assert "pwned" not in Path("/etc/passwd").read_text()


@needs_bwrap
def test_files_outside_cannot_be_seen_or_deleted(tmp_path: Path) -> None:
    canary = tmp_path / "canary.txt"
    canary.write_text("keep me")
    result = run_code("bash", f"rm -rf {tmp_path} {REPO}/README.md; ls {tmp_path} || echo gone")
    assert "keep me" not in result.stdout and "canary" not in result.stdout
    assert canary.read_text() == "keep me" and (REPO / "README.md").exists()


@needs_bwrap
def test_host_environment_secrets_are_invisible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSERVE_SECRET", "hunter2-s3cret")
    source = f"""
import glob, os
print(dict(os.environ))
for path in ["/proc/1/environ", "/proc/{os.getpid()}/environ", *glob.glob("/proc/*/environ")]:
    try:
        print(path, open(path, "rb").read())
    except OSError as e:
        print(path, type(e).__name__)
"""
    result = run_code("python", source)
    assert result.status == "ok" and "/proc/1/environ" in result.stdout
    assert "hunter2" not in result.stdout + result.stderr


@needs_bwrap
def test_no_network_not_even_the_hosts_loopback() -> None:
    # Never send a packet outside this machine: try the public address only from inside a
    # network namespace (were the sandbox to fall back to rlimits, this fails first).
    assert run_code("python", "pass").isolation == "bubblewrap"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        source = f"""
import socket
assert [n for _, n in socket.if_nameindex()] == ["lo"], "not in a private network namespace"
for addr in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
    try:
        socket.create_connection(addr, timeout=3).close()
        print("CONNECTED", addr)
    except OSError as e:
        print("failed", addr, type(e).__name__)
"""
        result = run_code("python", source)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert result.status == "ok" and "CONNECTED" not in result.stdout
    assert result.stdout.count("failed") == 2
    assert result.duration_s < 2  # failed at once, no timeouts waited out


@needs_bwrap
@pytest.mark.parametrize(
    ("lang", "source"),
    [
        ("python", "import sys\nfor _ in range(1 << 14):\n    sys.stdout.write('x' * 65536)"),
        ("bash", "yes"),
    ],
)
def test_printing_a_gigabyte_hits_the_output_cap(lang: str, source: str) -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run_code(lang, source, limits=Limits(output_bytes=10_000))
    assert result.status == "output_limit" and result.reason == "output exceeded 10000 bytes"
    assert len(result.stdout) == 10_000
    assert result.duration_s < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 50_000  # KiB


@needs_bwrap
def test_pool_runs_in_parallel_while_one_job_is_a_fork_bomb() -> None:
    jobs = [("python", f"print({i} * {i})", None) for i in range(7)]
    jobs.insert(3, ("python", FORK_BOMB, None))
    with SandboxPool(max_workers=4, limits=Limits(timeout_s=3)) as pool:
        results = pool.map(jobs)
    assert results[3].status == "timeout"
    others = results[:3] + results[4:]
    assert [r.status for r in others] == ["ok"] * 7
    assert [r.stdout for r in others] == [f"{i * i}\n" for i in range(7)]


def test_rlimits_fallback_reports_its_weaker_isolation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_module, "bwrap_available", lambda: False)
    monkeypatch.setenv("TIERSERVE_SECRET", "hunter2-s3cret")
    with Sandbox({"a.txt": "hi"}, Limits(timeout_s=1)) as box:
        result = box.run(
            "python", "import os\nprint(os.getcwd(), open('a.txt').read(), dict(os.environ))"
        )
        assert result.status == "ok" and result.isolation == "rlimits"
        assert result.stdout.startswith(f"{box.root} hi")
        assert "hunter2" not in result.stdout
        slow = box.run("bash", "sleep 4243.5 &\nsleep 4243.5")
    assert slow.status == "timeout" and slow.duration_s < 1.5
    _assert_gone("4243.5")


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="escapes"):
        Sandbox({"../outside.txt": "x"})
    with Sandbox() as box, pytest.raises(ValueError, match="language"):
        box.run("ruby", "puts 1")


@needs_bwrap
def test_tree_skips_symlinks_to_host_files() -> None:
    with Sandbox() as box:
        box.run("bash", "ln -s /etc/passwd leak && echo ok > real")
        os.symlink("/etc/hostname", box.root / "host-made-link")
        assert box.tree() == {"real": "ok\n"}


@needs_bwrap
def test_close_removes_what_the_program_locked() -> None:
    box = Sandbox()
    result = box.run("bash", "mkdir -p d/e && touch d/e/f && chmod 000 d/e d && chmod 500 .")
    assert result.status == "ok"
    box.close()
    assert not box.root.exists()


@needs_bwrap
def test_cli_sandbox_exec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = tmp_path / "prog.sh"
    program.write_text("echo hello; sleep 10")
    cli_main(["sandbox", "exec", "--lang", "bash", str(program), "--timeout", "0.5"])
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "timeout" and result["stdout"] == "hello\n"
    assert set(result) >= {"status", "exit_code", "stdout", "stderr", "reason", "duration_s"}
