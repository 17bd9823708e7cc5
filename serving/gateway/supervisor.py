"""Tier supervision: start each embedded tier as a `tierserve engine` child process, keep every
tier's health state current, restart crashed children with exponential backoff, and stop
them all on shutdown.

Children run in their own process group (a Ctrl-C at the terminal reaches only the gateway,
which drains before it stops them) and, on Linux, get SIGTERM from the kernel if the
gateway dies without cleaning up, so no tier outlives its gateway.
"""

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time

from router.policy import Tier
from serving.gateway.config import EmbeddedTier, SupervisorConfig
from serving.gateway.upstream import TierState, Upstream

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
# A tier healthy this long after a restart has recovered: the backoff starts over.
_STABLE_S = 60.0
# A tier process just started is probed this often (a refused connection on the loopback
# costs nothing), so it serves as soon as it answers rather than up to an interval later.
_STARTING_PROBE_S = 0.1


def _die_with_parent() -> None:
    """Runs in the child before exec: ask the kernel for SIGTERM when the gateway dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def engine_command(config: EmbeddedTier, port: int) -> list[str]:
    """The `tierserve engine` command line of an embedded tier."""
    command = [sys.executable, "-c", "from serving.cli import main; main()", "engine"]
    command += ["--model", str(config.model), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--served-model-name", config.model_name]
    options = {
        "--max-num-seqs": config.max_num_seqs,
        "--max-num-batched-tokens": config.max_num_batched_tokens,
        "--kv-cache-memory": config.kv_cache_memory_mib,
        "--max-model-len": config.max_model_len,
        "--api-key": config.api_key,
        "--speculative-config": config.speculative and config.speculative.model_dump_json(),
        "--dtype": config.dtype,
        "--kv-cache-dtype": config.kv_cache_dtype,
        "--device": config.device,
        "--gpu-memory-utilization": config.gpu_memory_utilization,
    }
    for flag, value in options.items():
        if value is not None:
            command += [flag, str(value)]
    return command + ["--enforce-eager"] * config.enforce_eager


class Supervisor:
    def __init__(self, upstreams: dict[Tier, Upstream], config: SupervisorConfig) -> None:
        self.upstreams = upstreams
        self.config = config
        self._processes: dict[Tier, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Start every tier and wait (up to the startup timeout) until all are healthy. A tier
        still down by then is logged and kept trying; the gateway serves with the other."""
        self._tasks = [
            asyncio.create_task(self._watch(u), name=f"watch-{u.tier}")
            for u in self.upstreams.values()
        ]
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if all(u.available for u in self.upstreams.values()):
                return
            if any(t.done() for t in self._tasks):
                break  # a watcher failed (cannot spawn): report below
            await asyncio.sleep(0.1)
        for task in self._tasks:
            if task.done() and task.exception():
                raise RuntimeError(f"tier supervision failed: {task.exception()}")
        down = [f"{u.tier} ({u.state})" for u in self.upstreams.values() if not u.available]
        log.error("tiers not healthy after %.0f s: %s", self.config.startup_timeout_s, down)

    async def stop(self) -> None:
        """Stop watching, then SIGTERM every child and SIGKILL those still alive after the
        stop timeout."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(self._terminate(tier) for tier in list(self._processes)))

    async def _terminate(self, tier: Tier) -> None:
        process = self._processes.pop(tier)
        self.upstreams[tier].state = TierState.STOPPED
        if process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), self.config.stop_timeout_s)
        except TimeoutError:
            log.warning(
                "tier %s did not stop in %.0f s: killing it", tier, self.config.stop_timeout_s
            )
            process.kill()
            await process.wait()

    async def _spawn(self, upstream: Upstream) -> asyncio.subprocess.Process:
        assert isinstance(upstream.config, EmbeddedTier)
        port = int(upstream.server_root.rsplit(":", 1)[1])
        env = dict(os.environ, OMP_NUM_THREADS=str(upstream.config.threads))
        process = await asyncio.create_subprocess_exec(
            *engine_command(upstream.config, port),
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        self._processes[upstream.tier] = process
        upstream.pid = process.pid
        log.info("tier %s: started pid %d on port %d", upstream.tier, process.pid, port)
        return process

    async def _watch(self, upstream: Upstream) -> None:
        """Keep one tier's state current; for an embedded tier, (re)start its process."""
        embedded = isinstance(upstream.config, EmbeddedTier)
        backoff = self.config.restart_backoff_s
        process = await self._spawn(upstream) if embedded else None
        healthy_since: float | None = None
        while True:
            if process is not None and process.returncode is not None:
                upstream.state = TierState.RESTARTING
                upstream.last_error = f"process exited with status {process.returncode}"
                log.error(
                    "tier %s: %s; restarting in %.1f s", upstream.tier, upstream.last_error, backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, self.config.max_restart_backoff_s)
                upstream.restarts += 1
                upstream.state = TierState.STARTING
                process, healthy_since = await self._spawn(upstream), None
            healthy = await upstream.probe(timeout_s=self.config.health_interval_s)
            now = time.monotonic()
            if healthy and upstream.state != TierState.HEALTHY:
                log.info("tier %s: healthy (%s)", upstream.tier, upstream.api_root)
                healthy_since = now
            elif not healthy and upstream.state == TierState.HEALTHY:
                log.warning("tier %s: unhealthy: %s", upstream.tier, upstream.last_error)
            if healthy:
                upstream.state = TierState.HEALTHY
                if healthy_since is not None and now - healthy_since > _STABLE_S:
                    backoff = self.config.restart_backoff_s
            elif upstream.state != TierState.STARTING:
                upstream.state = TierState.UNHEALTHY
            interval = self.config.health_interval_s
            if process is not None and upstream.state == TierState.STARTING:
                interval = min(interval, _STARTING_PROBE_S)
            with contextlib.suppress(asyncio.TimeoutError):
                # Wake at once when the process dies, else poll health at the interval.
                waiter = process.wait() if process is not None else asyncio.sleep(3600)
                await asyncio.wait_for(waiter, interval)
