"""A server's decode graphs of more than one row, compiled in a process of their own.

A served engine is ready once its one-row graph is in: one stream decodes at full speed
(`serving/model/decode_graphs.py`). Its larger graphs take most of a cold start, and compiled
in the serving process after that their tracing and code generation, which are Python, take
turns with the engine's thread for the GIL: served steps ran several times slower meanwhile.
Here a second process, at idle priority, builds the same engine from the same checkpoint and
config, so its graphs have the keys the server looks up (`serving/model/precompiled.graph_key`),
compiles them into the whole-graph store and exits; the server then loads them, each in a
fraction of a second. It takes only the CPU the server leaves, and dies with the server.

    python -m serving.engine.compile_process   # spec on stdin: written by `spawn`
"""

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

from serving.engine.engine_config import EngineConfig
from serving.engine.process_priority import make_idle

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0


def spawn(checkpoint: Path, config: EngineConfig) -> subprocess.Popen:
    """Start the process for an engine of `checkpoint` built with `config`; it compiles in
    its own process whatever the server would, and exits 0 once every graph is stored."""
    spec = (str(checkpoint), dataclasses.replace(config, compile_graphs_apart=False), os.getpid())
    # This process's import path, and not the working directory's (-P): the same code.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "serving.engine.compile_process"],
        stdin=subprocess.PIPE,
        env=env,
    )
    # Idle priority, which its compiler processes inherit: it runs on what the server leaves.
    make_idle(process.pid)
    assert process.stdin is not None
    process.stdin.write(pickle.dumps(spec))
    process.stdin.close()
    return process


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
