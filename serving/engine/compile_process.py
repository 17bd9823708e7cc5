"""A server's decode graphs of more than one row, compiled in a process of their own.

A served engine is ready once its one-row graph is in: one stream decodes at full speed
(`serving/model/graphs/decode.py`). Its larger graphs take most of a cold start, and compiled
in the serving process after that their tracing and code generation, which are Python, take
turns with the engine's thread for the GIL: served steps ran several times slower meanwhile.
Here a second process, at idle priority, builds the same engine from the same checkpoint and
config, so its graphs have the keys the server looks up (`graph_key` in
`serving/model/graphs/precompiled.py`), compiles them into the whole-graph store and exits;
the server then loads them, each in a fraction of a second. It takes only the CPU the server
leaves, and dies with the server.

Idle priority is not enough while the server serves one stream: that stream already runs at
full speed on the one-row graph, yet a compile busy on the other core slowed it (on the
virtual machines measured, any work there did; `loadtests/bench_startup.py`). So the server
stops the process (`CompileApart.hold`) while it serves a lone stream, and lets it go on while
it serves several, which the larger graphs are for, or none.

    python -m serving.engine.compile_process   # spec on stdin: written by `spawn`
"""

import dataclasses
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from serving.engine.engine_config import EngineConfig
from serving.engine.process_priority import make_idle, signal_group

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0


def spawn(checkpoint: Path, config: EngineConfig) -> subprocess.Popen:
    """Start the process for an engine of `checkpoint` built with `config`; it compiles in
    its own process whatever the server would, and exits 0 once every graph is stored."""
    spec = (str(checkpoint), dataclasses.replace(config, compile_graphs_apart=False), os.getpid())
    # This process's import path, and not the working directory's (-P): the same code.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # A process group of its own, with the compilers it starts, for `CompileApart.hold`.
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "serving.engine.compile_process"],
        stdin=subprocess.PIPE,
        env=env,
        process_group=0,
    )
    # Idle priority, which its compiler processes inherit: it runs on what the server leaves.
    make_idle(process.pid)
    assert process.stdin is not None
    process.stdin.write(pickle.dumps(spec))
    process.stdin.close()
    return process


class CompileApart:
    """A server engine's compile process: `start` starts it when the decode graphs ask
    (`serving/model/graphs/decode.py`), and the engine holds it still while it serves a
    lone stream (`hold`)."""

    def __init__(self, start: Callable[[], subprocess.Popen]) -> None:
        self._start = start
        self.process: subprocess.Popen | None = None
        self.held = False
        self._lock = threading.Lock()  # the graphs' thread starts it, the engine's holds it

    def __call__(self) -> subprocess.Popen:
        with self._lock:
            self.process = self._start()
            if self.held:
                self._signal(signal.SIGSTOP)
            return self.process

    def hold(self, held: bool) -> None:
        """Stop the process and its compilers (SIGSTOP to its process group) while `held`,
        and continue them after. Should the server die meanwhile, the group is orphaned
        with stopped members, and the kernel sends it SIGHUP and SIGCONT, which end it."""
        if held == self.held:
            return
        with self._lock:
            self.held = held
            self._signal(signal.SIGSTOP if held else signal.SIGCONT)

    def stop(self) -> None:
        """End the process and its compilers with the server (SIGKILL to the group, held or
        not) and wait for it, so that none outlives a server that stopped: each graph is
        stored whole or not at all, and a later start compiles what is missing."""
        with self._lock:
            process = self.process
            if process is not None and process.poll() is None:
                signal_group(process.pid, signal.SIGKILL)
                process.wait()

    def _signal(self, sig: int) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            signal_group(process.pid, sig)


def _exit_with(parent: int) -> None:
    """Exit as soon as the server that started this process is gone (it was re-parented)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def main() -> None:
    from serving.engine.llm_engine import LLMEngine  # this module is imported by it

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    checkpoint, config, parent = pickle.load(sys.stdin.buffer)
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    engine = LLMEngine.from_checkpoint(checkpoint, config)
    assert engine.graphs, "an engine without compiled decode steps has nothing to store"
    engine.wait_warm()  # the MTP drafter's graphs too, which the server compiles after these
    progress = engine.warmup()
    sys.exit(0 if progress.compiled == progress.wanted else 1)


if __name__ == "__main__":
    main()
