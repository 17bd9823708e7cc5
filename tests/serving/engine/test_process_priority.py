"""Idle priority for background processes: every thread of a process moves to `SCHED_IDLE` and
back, threads it creates meanwhile inherit the policy, and a process that has ended is no error
to the caller that reads its threads."""

import os
import subprocess
import sys

import pytest

from serving.engine.process_priority import can_leave_idle, make_idle, make_normal

# A process with a second thread, which starts a third once told to on stdin.
CHILD = """
import sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
"""


def policies(pid: int) -> list[int]:
    return [os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.skipif(not can_leave_idle(), reason="this user may not leave SCHED_IDLE")
def test_every_thread_goes_idle_and_back():
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline() == "ready\n"
        make_idle(child.pid)
        assert policies(child.pid) == [os.SCHED_IDLE] * 2
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "ready\n"
        assert policies(child.pid) == [os.SCHED_IDLE] * 3  # the new thread inherited it
        make_normal(child.pid)
        assert policies(child.pid) == [os.SCHED_OTHER] * 3
    finally:
        child.kill()
        child.wait()


def test_a_process_gone_is_an_error_to_report():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(ProcessLookupError):
        make_normal(child.pid)
