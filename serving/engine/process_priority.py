"""Background processes at idle priority: work that must not slow a serving tier.

A tier's larger decode graphs compile in a process of their own (`compile_process.py`), and
the gateway keeps a standby engine per tier past its imports (`serving/gateway/supervisor.py`).
Both are seconds of CPU on the cores a serving tier uses: a standby started beside a tier that
had just replaced a killed one slowed that tier's first requests (`loadtests/bench_startup.py
--kill`). At `SCHED_IDLE` a process runs only on CPU time nothing else wants. The parent sets
it, as soon as the process exists, so its start runs at that priority too, and threads the
process creates inherit it. Even so, on the virtual machines measured, a process busy on the
core a tier left idle slowed the tier's requests; so each is also held stopped while the
work it would slow runs (`CompileApart.hold`, the supervisor's standbys).

A standby that takes over a tier must serve at normal priority again, and leaving
`SCHED_IDLE` is allowed only to root, to a process with CAP_SYS_NICE, or where `RLIMIT_NICE`
permits nice 0 (sched(7)); where none holds, standbys run at normal priority, and the
supervisor says so once.
"""

import contextlib
import os
import resource
from pathlib import Path


def make_idle(pid: int) -> None:
    """Give process `pid` (each of its threads) idle priority."""
    _set_policy(pid, os.SCHED_IDLE)


def make_normal(pid: int) -> None:
    """Give process `pid` (each of its threads) the default policy again."""
    _set_policy(pid, os.SCHED_OTHER)


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to process group `pgid` (SIGSTOP and SIGCONT hold one still and let it go
    on); a group gone meanwhile, or not ours, is left alone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def can_leave_idle() -> bool:
    """Whether this process may move a child of its user out of `SCHED_IDLE` again."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= 20


def _set_policy(pid: int, policy: int) -> None:
    """Raises ProcessLookupError where `pid` is gone; a thread that ends meanwhile is skipped."""
    try:
        threads = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid}") from None
    for tid in threads:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:
            continue
