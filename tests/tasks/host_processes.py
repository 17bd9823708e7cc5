"""Host processes the sandbox tests watch or target."""

import os
import subprocess
import time
from pathlib import Path

FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


def alive_with(marker: str) -> list[int]:
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


def assert_gone(marker: str) -> None:
    """Killed namespaces are torn down asynchronously: allow a short grace."""
    for _ in range(40):
        if not alive_with(marker):
            return
        time.sleep(0.05)
    raise AssertionError(f"processes with {marker!r} outlived their run: {alive_with(marker)}")


def host_process(
    marker: str, uid: int | None, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """A sleeping host process of a sandbox's own uid (`Sandbox.uid`), so that only the
    namespaces, not file or signal permissions, keep its programs away from it."""
    user = {} if uid is None else {"user": uid}
    return subprocess.Popen(["sleep", marker], env=env or {}, **user)
