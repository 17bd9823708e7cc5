"""The sandbox: normal runs and limits under every isolation this machine has (unshare always;
bubblewrap where installed), the opt-in to weaker isolation, and the refusal where none works.
The hostile programs are in test_sandbox_red_team.py."""

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import tasks.sandbox.isolation as sandbox_module
from serving.cli import main as cli_main
from tasks.sandbox import (
    ISOLATION_ENV,
    Limits,
    Sandbox,
    SandboxPool,
    SandboxUnavailable,
    resolve_isolation,
    run_code,
)
from tests.tasks.host_processes import assert_gone


def test_python_sees_stdin_files_and_a_scrubbed_env(isolation: str) -> None:
    source = "import os\nprint(open('data/in.txt').read(), input(), os.getcwd())\n"
    source += "print(sorted(os.environ.items()))"
    result = run_code("python", source, {"data/in.txt": "from a file"}, stdin="from stdin\n")
    assert result.status == "ok" and result.exit_code == 0 and result.reason == "exit 0"
    assert result.isolation == isolation
    assert "from a file from stdin /sandbox" in result.stdout
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/sandbox", "LANG": "C.UTF-8"}
    env |= {"PYTHONPATH": "/sandbox", "PYTHONDONTWRITEBYTECODE": "1", "PWD": "/sandbox"}
    assert result.stdout.splitlines()[1] == str(sorted(env.items()))  # nothing of the host
    assert json.loads(json.dumps(result.to_json()))["status"] == "ok"


def test_files_persist_across_runs_and_tree_shows_them(isolation: str) -> None:
    with Sandbox({"a.txt": "one\n"}) as box:
        first = box.run("bash", "mkdir -p out && cat a.txt > out/b.txt && echo two >> out/b.txt")
        second = box.run("python", "print(open('out/b.txt').read().split())")
        assert first.status == second.status == "ok"
        assert second.stdout == "['one', 'two']\n"
        assert box.tree() == {"a.txt": "one\n", "out/b.txt": "one\ntwo\n"}
        root = box.root
    assert not root.exists()


def test_error_exit_is_reported(isolation: str) -> None:
    result = run_code("python", "raise SystemExit('boom')")
    assert (result.status, result.exit_code, result.reason) == ("error", 1, "exit 1")
    assert "boom" in result.stderr


def test_process_limit_stops_forking(isolation: str) -> None:
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


def test_rlimits_only_when_opted_in_and_then_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ISOLATION_ENV, "rlimits")
    monkeypatch.setenv("TIERSERVE_SECRET", "hunter2-s3cret")
    sandbox_module._log_choice.cache_clear()
    with caplog.at_level(logging.WARNING), Sandbox({"a.txt": "hi"}, Limits(timeout_s=1)) as box:
        result = box.run(
            "python", "import os\nprint(os.getcwd(), open('a.txt').read(), dict(os.environ))"
        )
        assert result.status == "ok" and result.isolation == "rlimits"
        assert result.stdout.startswith(f"{box.root} hi")
        assert "hunter2" not in result.stdout
        slow = box.run("bash", "sleep 4243.5 &\nsleep 4243.5")
    assert slow.status == "timeout" and slow.duration_s < 1.5
    assert_gone("4243.5")
    assert "isolation 'rlimits' opted in" in caplog.text


def _no_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulate a machine where neither mechanism works (e.g. user namespaces disabled)."""
    problems = {"bubblewrap": "bwrap is not installed", "unshare": "unshare failed: EPERM"}
    monkeypatch.setattr(sandbox_module, "probe", problems.get)


def test_no_isolation_is_refused_and_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _no_namespaces(monkeypatch)
    monkeypatch.delenv(ISOLATION_ENV, raising=False)
    before = set(os.listdir(tempfile.gettempdir()))
    for call in (
        lambda: run_code("python", "print('ran')"),
        lambda: Sandbox(),
        lambda: SandboxPool(2),
        lambda: run_code("python", "print('ran')", isolation="unshare"),
    ):
        with pytest.raises(SandboxUnavailable) as refused:
            call()
        message = str(refused.value)
        assert "apt-get install bubblewrap" in message and "--isolation rlimits" in message
        assert f"{ISOLATION_ENV}=rlimits" in message and "unshare failed: EPERM" in message
    assert set(os.listdir(tempfile.gettempdir())) == before  # refused before making anything
    assert resolve_isolation("rlimits") == "rlimits"  # the explicit opt-in still works


def test_auto_takes_the_strongest_that_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISOLATION_ENV, raising=False)
    monkeypatch.setattr(sandbox_module, "probe", lambda isolation: None)
    assert resolve_isolation() == "bubblewrap"
    monkeypatch.setattr(sandbox_module, "probe", {"bubblewrap": "bwrap is not installed"}.get)
    assert resolve_isolation() == "unshare" == resolve_isolation("auto")
    with pytest.raises(SandboxUnavailable, match="bwrap is not installed"):
        resolve_isolation("bubblewrap")
    monkeypatch.setenv(ISOLATION_ENV, "rlimit")  # a typo refuses, it never weakens
    with pytest.raises(SandboxUnavailable, match="unknown sandbox isolation 'rlimit'"):
        resolve_isolation()


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="escapes"):
        Sandbox({"../outside.txt": "x"})
    with Sandbox() as box, pytest.raises(ValueError, match="language"):
        box.run("ruby", "puts 1")


def test_tree_skips_symlinks_to_host_files(isolation: str) -> None:
    with Sandbox() as box:
        box.run("bash", "ln -s /etc/passwd leak && echo ok > real")
        os.symlink("/etc/hostname", box.root / "host-made-link")
        assert box.tree() == {"real": "ok\n"}


def test_close_removes_what_the_program_locked(isolation: str) -> None:
    box = Sandbox()
    result = box.run("bash", "mkdir -p d/e && touch d/e/f && chmod 000 d/e d && chmod 500 .")
    assert result.status == "ok"
    box.close()
    assert not box.root.exists()


def test_cli_sandbox_exec(
    isolation: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    program = tmp_path / "prog.sh"
    program.write_text("echo hello; sleep 10")
    cli_main(["sandbox", "exec", "--lang", "bash", str(program), "--timeout", "0.5"])
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "timeout" and result["stdout"] == "hello\n"
    assert set(result) >= {"status", "exit_code", "stdout", "stderr", "reason", "duration_s"}
    assert result["isolation"] == isolation
    cli_main(["sandbox", "exec", "--lang", "bash", str(program), "--isolation", "rlimits"])
    assert json.loads(capsys.readouterr().out)["isolation"] == "rlimits"


def test_cli_refuses_without_isolation(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_namespaces(monkeypatch)
    monkeypatch.delenv(ISOLATION_ENV, raising=False)
    program = tmp_path / "prog.py"
    program.write_text("print('ran')")
    with pytest.raises(SystemExit) as exited:
        cli_main(["sandbox", "exec", "--lang", "python", str(program)])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "refusing to run untrusted code" in err
    assert "apt-get install bubblewrap" in err


@pytest.mark.parametrize("domain", ["code", "terminal"])
def test_eval_refuses_rather_than_scoring_zero(
    domain: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_namespaces(monkeypatch)
    monkeypatch.delenv(ISOLATION_ENV, raising=False)
    with pytest.raises(SystemExit) as exited:
        cli_main(["eval", "tasks", "--reference", "short", "--domains", domain, "--n", "1"])
    assert exited.value.code == 2
    assert "refusing to run untrusted code" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs sandboxes as leased host uids")
def test_each_live_sandbox_runs_as_a_host_uid_of_its_own(isolation: str) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "from tasks.sandbox.isolation import UidLease\n"
         "lease = UidLease()\nprint(lease.uid, flush=True)\nimport time; time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        held = int(holder.stdout.readline())  # leased by another process
        with Sandbox({"a.txt": "a"}) as first, Sandbox() as second:
            uids = {first.uid, second.uid, held}
            assert len(uids) == 3 and min(uids) >= sandbox_module.FIRST_UID
            assert (first.root / "a.txt").stat().st_uid == first.uid
            made = first.run("bash", "touch made && id -u")
            assert made.status == "ok" and (first.root / "made").stat().st_uid == first.uid
            inside = first.uid if isolation == "unshare" else 1000  # bubblewrap maps it
            assert int(made.stdout) == inside
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root leases host uids")
def test_uid_locks_go_to_the_first_writable_place_and_only_a_private_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        sandbox_module, "UID_LOCK_DIRS", (str(tmp_path / "no" / "such"), str(tmp_path))
    )
    lease = sandbox_module.UidLease()
    assert (tmp_path / "tierserve-uids" / str(lease.uid)).is_file()
    lease.release()
    (tmp_path / "tierserve-uids").chmod(0o777)  # anyone could hold or swap the locks
    with pytest.raises(SandboxUnavailable, match="only root writes"):
        sandbox_module.UidLease()
    (tmp_path / "tierserve-uids").chmod(0o700)
    os.chown(tmp_path / "tierserve-uids", 1000, 1000)
    with pytest.raises(SandboxUnavailable, match="only root writes"):
        sandbox_module.UidLease()
    monkeypatch.setattr(sandbox_module, "UID_LOCK_DIRS", (str(tmp_path / "no" / "such"),))
    with pytest.raises(SandboxUnavailable, match="no writable place"):
        sandbox_module.UidLease()
