"""Run one command as its own process group under a wall-clock timeout and an output cap.

Nothing here isolates anything: `sandbox.py` builds the command (bubblewrap, unshare or the
opted-in rlimits fallback) and this module only watches it. The group is always killed at
the end, so a background process a program leaves behind cannot outlive its run.
"""

import contextlib
import os
import selectors
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import IO


@dataclass
class Limits:
    """Per-run budgets. `output_bytes` caps stdout and stderr together."""

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    file_size_mb: int = 16
    processes: int = 64
    open_files: int = 64
    output_bytes: int = 64_000

    def prlimit_args(self) -> list[str]:
        """The `prlimit` options for these limits: the CPU hard limit is one second above the
        soft one, so a program first gets SIGXCPU (reported as the CPU limit), then SIGKILL."""
        mib = 1 << 20
        return [
            f"--cpu={self.cpu_s}:{self.cpu_s + 1}",
            f"--as={self.memory_mb * mib}",
            f"--fsize={self.file_size_mb * mib}",
            f"--nproc={self.processes}",
            f"--nofile={self.open_files}",
        ]


@dataclass
class SandboxResult:
    """What a run did. `exit_code` is None unless the program exited by itself."""

    status: str  # "ok" | "error" | "timeout" | "killed" | "output_limit"
    exit_code: int | None
    stdout: str
    stderr: str
    reason: str
    duration_s: float
    isolation: str  # "bubblewrap" | "unshare" | "rlimits"

    def to_json(self) -> dict:
        return asdict(self)


def run_limited(
    argv: list[str],
    *,
    cwd: str,
    env: dict[str, str],
    stdin: IO[bytes],
    limits: Limits,
    isolation: str,
    popen_kwargs: dict | None = None,
) -> SandboxResult:
    """Run `argv` in a new session and collect its capped output.

    Signals by number: bubblewrap and the unshare path's shell (and bash) report a child
    killed by signal N as exit code 128 + N, so under namespaces such codes are read as kills.
    """
    start = time.monotonic()
    deadline = start + limits.timeout_s
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        **(popen_kwargs or {}),
    )
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    held = 0
    over_cap = timed_out = exited = False
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and not over_cap:
            now = time.monotonic()
            if now >= deadline:
                timed_out = not exited
                break
            # Short waits so that an exit is noticed even while a straggler holds a pipe open.
            for key, _ in sel.select(min(deadline - now, 0.05)):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fd)
                    continue
                room = limits.output_bytes - held
                chunks[key.fd].append(data[:room])
                held += min(len(data), room)
                if len(data) > room:
                    over_cap = True
                    break
            if not exited and _has_exited(proc.pid):
                # Kill stragglers before reaping: the unreaped leader keeps its group id ours.
                exited = True
                _kill_group(proc.pid)
                deadline = min(deadline, time.monotonic() + 1.0)
    _kill_group(proc.pid)
    returncode = proc.wait()
    duration = time.monotonic() - start
    proc.stdout.close()
    proc.stderr.close()
    stdout = b"".join(chunks[out_fd]).decode("utf-8", errors="replace")
    stderr = b"".join(chunks[err_fd]).decode("utf-8", errors="replace")
    status, exit_code, reason = _classify(
        returncode, stderr, limits, isolation, timed_out=timed_out, over_cap=over_cap
    )
    return SandboxResult(status, exit_code, stdout, stderr, reason, round(duration, 3), isolation)


def _has_exited(pid: int) -> bool:
    """Whether the process has exited, without reaping it (WNOWAIT)."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return info is not None


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is already gone
        os.killpg(pgid, signal.SIGKILL)


_SIGNAL_HINTS = {
    signal.SIGKILL: "memory, CPU or process limit?",
    signal.SIGXCPU: "CPU limit",
    signal.SIGXFSZ: "file size limit",
}


def _classify(
    returncode: int,
    stderr: str,
    limits: Limits,
    isolation: str,
    *,
    timed_out: bool,
    over_cap: bool,
) -> tuple[str, int | None, str]:
    """(status, exit_code, reason) for a finished run; our own kills take precedence."""
    if over_cap:
        return "output_limit", None, f"output exceeded {limits.output_bytes} bytes"
    if timed_out:
        return "timeout", None, f"timed out after {float(limits.timeout_s)} s"
    signum = -returncode if returncode < 0 else 0
    if isolation != "rlimits" and 128 < returncode <= 128 + 64:
        signum = returncode - 128
    if signum:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        hint = _SIGNAL_HINTS.get(signum)
        return "killed", None, f"killed by {name}" + (f" ({hint})" if hint else "")
    if returncode == 0:
        return "ok", 0, "exit 0"
    reason = f"exit {returncode}"
    if "MemoryError" in stderr[-2000:]:
        reason += f" (MemoryError: memory limit {limits.memory_mb} MB)"
    return "error", returncode, reason
