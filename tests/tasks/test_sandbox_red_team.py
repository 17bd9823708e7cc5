"""Red-team runs: hostile programs that must be contained under every isolation this machine
has: bombs, escapes from the work dir, the host's network, processes, secrets, /tmp, setuid."""

import json
import os
import resource
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.sandbox import (
    Limits,
    Sandbox,
    SandboxPool,
    run_code,
)
from tests import REPO
from tests.tasks.host_processes import FORK_BOMB, assert_gone, host_process


def test_fork_bomb_is_contained_and_the_host_stays_responsive(isolation: str) -> None:
    result = run_code("python", FORK_BOMB + "# bomb-7f3a", limits=Limits(timeout_s=2))
    assert result.status == "timeout" and result.reason == "timed out after 2.0 s"
    assert result.duration_s < 3
    start = time.monotonic()
    after = run_code("python", "print('still here')")
    assert after.status == "ok" and after.stdout == "still here\n"
    assert time.monotonic() - start < 2
    assert_gone("bomb-7f3a")


def test_memory_bomb_fails_inside_the_limit(isolation: str) -> None:
    result = run_code("python", "x = bytearray(4 << 30)\nprint('allocated')")
    assert result.status == "error" and "allocated" not in result.stdout
    assert "MemoryError" in result.reason and "512 MB" in result.reason


def test_infinite_loop_hits_the_cpu_limit(isolation: str) -> None:
    result = run_code("python", "while True: pass", limits=Limits(cpu_s=1, timeout_s=10))
    assert result.status == "killed" and "SIGXCPU" in result.reason
    assert result.duration_s < 4


def test_sleep_past_the_timeout_is_killed_in_time_with_its_children(isolation: str) -> None:
    result = run_code("bash", "sleep 4242.5 &\nsleep 4242.5", limits=Limits(timeout_s=1))
    assert result.status == "timeout" and result.reason == "timed out after 1.0 s"
    assert 1.0 <= result.duration_s < 1.5
    assert_gone("4242.5")


def test_file_size_limit(isolation: str) -> None:
    with Sandbox(limits=Limits(file_size_mb=1)) as box:
        result = box.run("bash", "head -c 4000000 /dev/zero > big")
        assert result.status == "killed" and "SIGXFSZ" in result.reason
        assert (box.root / "big").stat().st_size <= 1 << 20


def test_writes_outside_the_work_dir_fail(isolation: str, tmp_path: Path) -> None:
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


def test_files_outside_cannot_be_seen_or_deleted(isolation: str, tmp_path: Path) -> None:
    canary = tmp_path / "canary.txt"
    canary.write_text("keep me")
    result = run_code("bash", f"rm -rf {tmp_path} {REPO}/README.md; ls {tmp_path} || echo gone")
    assert "keep me" not in result.stdout and "canary" not in result.stdout
    assert canary.read_text() == "keep me" and (REPO / "README.md").exists()


def test_host_environment_secrets_are_invisible(
    isolation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
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


def test_no_network_not_even_the_hosts_loopback(isolation: str) -> None:
    # Never send a packet outside this machine: try the public address only from inside a
    # network namespace (the assertion on the interfaces fails first otherwise).
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


def test_udp_to_the_hosts_loopback_never_arrives(isolation: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("127.0.0.1", 0))
        server.setblocking(False)
        port = server.getsockname()[1]
        source = f"""
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(3):
    try:
        s.sendto(b"pwned", ("127.0.0.1", {port}))
        print("sent")  # bubblewrap brings up a private lo: sending works, arriving must not
    except OSError as e:
        print("failed", type(e).__name__)
"""
        result = run_code("python", source)
        time.sleep(0.1)
        with pytest.raises(BlockingIOError):
            server.recvfrom(64)
    assert result.status == "ok" and len(result.stdout.splitlines()) == 3


def test_ipv6_loopback_is_unreachable(isolation: str) -> None:
    with socket.socket(socket.AF_INET6) as listener:
        listener.bind(("::1", 0))  # this host has ::1: the test means something
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        source = f"""
import socket
try:
    socket.create_connection(("::1", {port}), timeout=3).close()
    print("CONNECTED")
except OSError as e:
    print("failed", type(e).__name__)
"""
        result = run_code("python", source)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert result.status == "ok" and result.stdout.startswith("failed")


@pytest.fixture
def unix_listeners() -> Iterator[tuple[str, str, list[socket.socket]]]:
    """A unix socket at a world-writable host path and one in the abstract namespace (which
    belongs to the network namespace), both listening and open to everyone."""
    directory = tempfile.mkdtemp(prefix="tierserve-redteam-")
    os.chmod(directory, 0o777)
    path = os.path.join(directory, "host.sock")
    abstract = "\0tierserve-redteam-" + secrets.token_hex(8)
    listeners = []
    for address in (path, abstract):
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(address)
        listener.listen()
        listener.setblocking(False)
        listeners.append(listener)
    os.chmod(path, 0o777)
    yield path, abstract, listeners
    for listener in listeners:
        listener.close()
    shutil.rmtree(directory)


def test_unix_sockets_of_the_host_are_unreachable(
    isolation: str, unix_listeners: tuple[str, str, list[socket.socket]]
) -> None:
    path, abstract, listeners = unix_listeners
    source = f"""
import socket
for address in [{path!r}, {abstract!r}]:
    try:
        socket.socket(socket.AF_UNIX).connect(address)
        print("CONNECTED", repr(address))
    except OSError as e:
        print("failed", type(e).__name__)
"""
    result = run_code("python", source)
    assert result.status == "ok" and "CONNECTED" not in result.stdout
    assert result.stdout.split() == [
        "failed",
        "FileNotFoundError",
        "failed",
        "ConnectionRefusedError",
    ]
    for listener in listeners:
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_host_processes_are_invisible_in_proc(isolation: str) -> None:
    box = Sandbox()
    host = host_process("4246.5", box.uid, env={"TIERSERVE_SECRET": "hunter3-proc"})
    try:
        source = """
import os
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print("pids", pids)
for pid in pids:
    for what in ("cmdline", "environ"):
        try:
            data = open(f"/proc/{pid}/{what}", "rb").read()
        except OSError:
            continue
        if b"4246.5" in data or b"hunter3" in data:
            print("FOUND", pid, what)
"""
        result = box.run("python", source)
        assert host.poll() is None
    finally:
        host.kill()
        host.wait()
        box.close()
    assert result.status == "ok" and "FOUND" not in result.stdout
    pids = json.loads(result.stdout.split("pids ", 1)[1].splitlines()[0])
    assert len(pids) <= 3 and max(pids) < 100  # a fresh PID namespace: this run's only


def test_signals_cannot_reach_host_processes(isolation: str) -> None:
    box = Sandbox()
    host = host_process("4247.5", box.uid)
    try:
        source = f"""
import os, signal
for pid in ({host.pid}, -1):
    try:
        os.kill(pid, signal.SIGKILL)
        print("sent", pid)
    except OSError as e:
        print("failed", pid, type(e).__name__)
"""
        result = box.run("python", source)
        time.sleep(0.2)
        assert host.poll() is None, "the sandbox killed a host process"
    finally:
        host.kill()
        host.wait()
        box.close()
    assert result.status in ("ok", "killed")  # kill(-1) may take the program's own group


def test_runs_unprivileged_without_capabilities(isolation: str) -> None:
    source = "import os\nprint(os.getuid(), os.geteuid(), os.getgid())\n"
    source += "print(open('/proc/self/status').read())"
    result = run_code("python", source)
    assert result.status == "ok"
    uid, euid, gid = map(int, result.stdout.split("\n", 1)[0].split())
    assert 0 not in (uid, euid, gid)
    status = dict(line.split(":\t", 1) for line in result.stdout.splitlines()[1:] if ":\t" in line)
    assert status["CapEff"] == status["CapPrm"] == status["CapBnd"] == "0000000000000000"
    assert status["NoNewPrivs"] == "1"


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can make a setuid-root binary")
def test_a_setuid_root_binary_grants_nothing(isolation: str) -> None:
    with Sandbox() as box:
        suid = box.root / "suid-id"
        shutil.copy("/usr/bin/id", suid)
        os.chown(suid, 0, 0)
        os.chmod(suid, 0o4755)
        assert (
            subprocess.run([suid, "-u"], capture_output=True, text=True, user=65534).stdout == "0\n"
        )
        result = box.run("bash", "./suid-id -u; ./suid-id -g")
    assert result.status == "ok"
    assert "0" not in result.stdout.split()


def test_writes_to_the_hosts_tmp_stay_private(isolation: str) -> None:
    name = f"/tmp/tierserve-redteam-{secrets.token_hex(8)}"
    source = f"""
import os
print(os.listdir("/tmp"))
open({name!r}, "w").write("pwned")
print(open({name!r}).read())
"""
    result = run_code("python", source)
    assert result.status == "ok" and result.stdout == "[]\npwned\n"  # a private, empty /tmp
    assert not os.path.exists(name)


@pytest.mark.parametrize(
    ("lang", "source"),
    [
        ("python", "import sys\nfor _ in range(1 << 14):\n    sys.stdout.write('x' * 65536)"),
        ("bash", "yes"),
    ],
)
def test_printing_a_gigabyte_hits_the_output_cap(isolation: str, lang: str, source: str) -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run_code(lang, source, limits=Limits(output_bytes=10_000))
    assert result.status == "output_limit" and result.reason == "output exceeded 10000 bytes"
    assert len(result.stdout) == 10_000
    assert result.duration_s < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 50_000  # KiB


def test_pool_runs_in_parallel_while_one_job_is_a_fork_bomb(isolation: str) -> None:
    jobs = [("python", f"print({i} * {i})", None) for i in range(7)]
    jobs.insert(3, ("python", FORK_BOMB, None))
    with SandboxPool(max_workers=4, limits=Limits(timeout_s=3)) as pool:
        results = pool.map(jobs)
    assert results[3].status == "timeout"
    others = results[:3] + results[4:]
    assert [r.status for r in others] == ["ok"] * 7
    assert [r.stdout for r in others] == [f"{i * i}\n" for i in range(7)]


def test_a_fork_bomb_leaves_the_process_budget_of_other_sandboxes_alone(isolation: str) -> None:
    """Each sandbox's process limit is its own: bash that forks (pipelines, command
    substitution) keeps working in the sandboxes that run while another one bombs."""
    forking = "for i in 1 2 3 4 5 6 7 8; do echo $(echo $i) | cat; done | wc -l"
    with SandboxPool(max_workers=4, limits=Limits(timeout_s=4)) as pool:
        bomb = pool.submit("python", FORK_BOMB)
        time.sleep(0.5)  # the bomb has used up its budget before the others start
        results = pool.map([("bash", forking, None)] * 12)
        assert bomb.result().status == "timeout"
    assert [(r.status, r.stdout, r.stderr) for r in results] == [("ok", "8\n", "")] * 12
