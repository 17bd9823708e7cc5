"""Tier supervision: start each embedded tier as a `tierserve engine` child process and each
vllm tier as vLLM's OpenAI server (`serving/gateway/vllm_tier.py`), keep every tier's health
state current, restart crashed children with exponential backoff, and stop them all on
shutdown.

The gateway listens while its tiers start and warm up, so its /health can say how far they
are; a tier takes traffic once its own /health answers 200 (it serves at full speed), and the
supervisor logs one line when every tier is ready, with how long each took.

A restart's start is mostly imports (torch, dynamo, inductor, FastAPI), so, as a process
pool keeps workers forked ahead, the supervisor keeps one standby per embedded tier once the
tier is ready: `tierserve engine --standby` past its imports, waiting for a line on its stdin
before it loads the checkpoint and binds the tier's port. Its stdin is a socket, on which it
also says when it is past its imports (/health's `standby_ready`). A tier that dies is
replaced by its standby, and a new standby is started once the replacement is ready, at
idle priority until it takes over (`serving/engine/process_priority.py`). Idle priority did
not keep its imports from slowing a lone request: on the virtual machines measured, any work
on the core a tier left idle slowed that tier (`loadtests/bench_startup.py --kill`). So while
the gateway has exactly one request in flight, the standbys are held stopped (SIGSTOP), as a
server holds its compile process while it serves a lone stream
(`serving/engine/compile_process.py`); with several in flight they go on at idle priority,
on what the tiers leave, so one is ready again soon under load too. A standby holds no
weights (the imports' memory only) and exits when its stdin closes.

Children run in their own process group (a Ctrl-C at the terminal reaches only the gateway,
which drains before it stops them) and, on Linux, get SIGTERM from the kernel if the
gateway dies without cleaning up, so no tier outlives its gateway; a standby gets SIGKILL
instead, since one held stopped would never act on SIGTERM. A child that has exited (or
been stopped) has what is left of its process group killed: vLLM's server runs its engine
in a process of its own, which would otherwise outlive a killed server and keep its memory.
"""

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

from router.policy import Tier
from serving.engine.process_priority import (
    can_leave_idle,
    make_idle,
    make_normal,
    signal_group,
)
from serving.gateway.config import EmbeddedTier, SupervisedTier, SupervisorConfig, VllmTier
from serving.gateway.upstream import Probe, TierState, Upstream
from serving.gateway.vllm_tier import vllm_command, vllm_env

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
# A tier healthy this long after a restart has recovered: the backoff starts over.
_STABLE_S = 60.0
# A tier process just started, or warming up, is probed this often (a refused connection on
# the loopback costs nothing, a warming tier's 503 little), so it takes traffic as soon as it
# is ready rather than up to an interval later.
_STARTING_PROBE_S = 0.1


def _die_with_parent(sig: int) -> None:
    """Runs in the child before exec: ask the kernel for `sig` when the gateway dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, sig)


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


def child_process(config: SupervisedTier, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a tier the gateway starts."""
    if isinstance(config, VllmTier):
        return vllm_command(config, port), vllm_env(config)
    return engine_command(config, port), dict(os.environ, OMP_NUM_THREADS=str(config.threads))


# What a standby writes on its stdin once past its imports.
STANDBY_READY = b"ready\n"


def _kill_group(pid: int) -> None:
    """SIGKILL whatever is left of an exited child's process group (its own children)."""
    signal_group(pid, signal.SIGKILL)


@dataclass
class Standby:
    """A standby process and the gateway's end of the socket that is its stdin."""

    process: asyncio.subprocess.Process
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def wait_ready(self) -> bool:
        """Until it says it is past its imports; False if it ended first."""
        with contextlib.suppress(ConnectionError):
            return await self.reader.readline() == STANDBY_READY
        return False

    async def release(self) -> bool:
        """Tell it to start, at normal priority again, the socket's last word; False if it
        has died meanwhile."""
        try:
            if self.process.returncode is not None:
                return False
            signal_group(self.process.pid, signal.SIGCONT)
            if can_leave_idle():
                make_normal(self.process.pid)
            self.writer.write(b"start\n")
            await self.writer.drain()
        except (ConnectionError, ProcessLookupError):
            return False
        finally:
            self.writer.close()
        return True


class Supervisor:
    def __init__(self, upstreams: dict[Tier, Upstream], config: SupervisorConfig) -> None:
        self.upstreams = upstreams
        self.config = config
        self._processes: dict[Tier, asyncio.subprocess.Process] = {}
        self._standbys: dict[Tier, Standby] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._began = time.monotonic()
        self._warned_priority = False
        self._announced = False  # the all-ready line has been logged
        self._held = False  # a lone request is in flight: standbys are held stopped
        for upstream in upstreams.values():
            upstream.on_in_flight = self._traffic_changed

    def _traffic_changed(self) -> None:
        """Hold the standbys stopped while exactly one request is in flight, and let them
        go on otherwise."""
        held = sum(u.in_flight for u in self.upstreams.values()) == 1
        if held != self._held:
            self._held = held
            for standby in self._standbys.values():
                signal_group(standby.process.pid, signal.SIGSTOP if held else signal.SIGCONT)

    async def start(self) -> None:
        """Start every supervised tier's process (raising if one cannot be spawned) and watch
        every tier; returns at once. A tier still not ready after the startup timeout is
        logged and kept trying; the gateway serves with the other."""
        self._began = time.monotonic()
        processes = {
            tier: await self._spawn(u)
            for tier, u in self.upstreams.items()
            if isinstance(u.config, SupervisedTier)
        }
        self._tasks = [
            asyncio.create_task(self._watch(u, processes.get(tier)), name=f"watch-{tier}")
            for tier, u in self.upstreams.items()
        ]
        self._tasks.append(asyncio.create_task(self._startup_deadline(), name="startup-deadline"))

    async def _startup_deadline(self) -> None:
        await asyncio.sleep(self.config.startup_timeout_s)
        down = [f"{u.tier} ({u.state})" for u in self.upstreams.values() if not u.available]
        if down and not self._announced:  # after that, a tier down is a restart, logged
            log.error("tiers not ready after %.0f s: %s", self.config.startup_timeout_s, down)

    def _became_ready(self, upstream: Upstream, now: float) -> None:
        """Log a tier's readiness, and once, the first time all are ready, the one line
        that says the gateway serves at full speed."""
        if upstream.started_at is not None:
            upstream.ready_s = now - upstream.started_at
            log.info("tier %s: ready in %.1f s (%s)", upstream.tier, upstream.ready_s,
                     upstream.api_root)  # fmt: skip
        else:
            log.info("tier %s: ready (%s)", upstream.tier, upstream.api_root)
        upstream.state = TierState.HEALTHY
        if self._announced or not all(u.available for u in self.upstreams.values()):
            return
        self._announced = True
        times = ", ".join(
            f"{u.tier} {u.ready_s:.1f} s" if u.ready_s is not None else f"{u.tier} (remote)"
            for u in self.upstreams.values()
        )
        log.info("ready: every tier serves one stream at full speed, %.1f s after start (%s)",
                 now - self._began, times)  # fmt: skip

    async def stop(self) -> None:
        """Stop watching, then SIGTERM every child and SIGKILL those still alive after the
        stop timeout."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for tier in self._processes:
            self.upstreams[tier].state = TierState.STOPPED
        processes = [*self._processes.values(), *(s.process for s in self._standbys.values())]
        for standby in self._standbys.values():
            standby.writer.close()
        self._processes, self._standbys = {}, {}
        await asyncio.gather(*(self._terminate(p) for p in processes))

    async def _terminate(self, process: asyncio.subprocess.Process) -> None:
        if process.returncode is None:
            process.terminate()
            signal_group(process.pid, signal.SIGCONT)  # a held standby, to act on it
            try:
                await asyncio.wait_for(process.wait(), self.config.stop_timeout_s)
            except TimeoutError:
                log.warning(
                    "pid %d did not stop in %.0f s: killing it",
                    process.pid,
                    self.config.stop_timeout_s,
                )
                process.kill()
                await process.wait()
        _kill_group(process.pid)

    async def _spawn(self, upstream: Upstream) -> asyncio.subprocess.Process:
        """Start the tier: its standby if it has one alive, else a new process."""
        standby = self._standbys.pop(upstream.tier, None)
        upstream.standby_pid, upstream.standby_ready = None, False
        process = None
        if standby is not None:
            if await standby.release():
                process = standby.process
            else:
                log.warning("tier %s: its standby pid %d is gone; starting anew", upstream.tier,
                            standby.process.pid)  # fmt: skip
                _kill_group(standby.process.pid)
        if process is None:
            process = await self._start_process(upstream)
        self._processes[upstream.tier] = process
        upstream.pid = process.pid
        upstream.started_at = time.monotonic()
        port = upstream.server_root.rsplit(":", 1)[1]
        log.info("tier %s: started pid %d on port %s", upstream.tier, process.pid, port)
        return process

    async def _start_process(
        self, upstream: Upstream, standby: socket.socket | None = None
    ) -> asyncio.subprocess.Process:
        """The tier's process; a standby when `standby` (its stdin) is given."""
        assert isinstance(upstream.config, SupervisedTier)
        port = int(upstream.server_root.rsplit(":", 1)[1])
        command, env = child_process(upstream.config, port)
        return await asyncio.create_subprocess_exec(
            *command,
            *["--standby"] * (standby is not None),
            stdin=standby,
            env=env,
            start_new_session=True,
            preexec_fn=(
                functools.partial(_die_with_parent, signal.SIGKILL if standby else signal.SIGTERM)
                if sys.platform == "linux"
                else None
            ),
        )

    async def _keep_standby(self, upstream: Upstream) -> None:
        """Start the tier's standby if it should have one and has none alive."""
        if not (self.config.standby and isinstance(upstream.config, EmbeddedTier)):
            return
        standby = self._standbys.get(upstream.tier)
        if standby is None or standby.process.returncode is not None:
            ours, theirs = socket.socketpair()
            try:
                process = await self._start_process(upstream, standby=theirs)
            finally:
                theirs.close()
            standby = Standby(process, *await asyncio.open_unix_connection(sock=ours))
            if self._held:
                signal_group(process.pid, signal.SIGSTOP)
            # Its imports at idle priority: they would slow the tier it stands by for.
            if can_leave_idle():
                make_idle(process.pid)
            elif not self._warned_priority:
                self._warned_priority = True
                log.warning(
                    "standbys start at normal priority: this user may not move a process out "
                    "of idle priority again (RLIMIT_NICE), so their imports share the CPU "
                    "with the tiers"
                )
            self._standbys[upstream.tier] = standby
            upstream.standby_pid, upstream.standby_ready = process.pid, False
            log.info("tier %s: standby pid %d", upstream.tier, process.pid)
            self._tasks.append(asyncio.create_task(self._standby_ready(upstream, standby)))

    async def _standby_ready(self, upstream: Upstream, standby: Standby) -> None:
        if await standby.wait_ready() and self._standbys.get(upstream.tier) is standby:
            upstream.standby_ready = True
            log.info("tier %s: standby pid %d ready", upstream.tier, standby.process.pid)

    async def _watch(self, upstream: Upstream, process: asyncio.subprocess.Process | None) -> None:
        """Keep one tier's state current; for a supervised tier (`process`), restart it."""
        backoff = self.config.restart_backoff_s
        healthy_since: float | None = None
        while True:
            if process is not None and process.returncode is not None:
                upstream.state = TierState.RESTARTING
                upstream.last_error = f"process exited with status {process.returncode}"
                _kill_group(process.pid)
                log.error(
                    "tier %s: %s; restarting in %.1f s", upstream.tier, upstream.last_error, backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, self.config.max_restart_backoff_s)
                upstream.restarts += 1
                upstream.state = TierState.STARTING
                process, healthy_since = await self._spawn(upstream), None
            probe = await upstream.probe(timeout_s=self.config.health_interval_s)
            now = time.monotonic()
            if probe == Probe.READY:
                if upstream.state != TierState.HEALTHY:
                    self._became_ready(upstream, now)
                    healthy_since = now
                    await self._keep_standby(upstream)
                if healthy_since is not None and now - healthy_since > _STABLE_S:
                    backoff = self.config.restart_backoff_s
            elif probe == Probe.WARMING:
                if upstream.state != TierState.WARMING:
                    log.info("tier %s: warming up: %s", upstream.tier, upstream.warmup)
                upstream.state = TierState.WARMING
            elif upstream.state == TierState.HEALTHY:
                log.warning("tier %s: unhealthy: %s", upstream.tier, upstream.last_error)
                upstream.state = TierState.UNHEALTHY
            elif upstream.state not in (TierState.STARTING, TierState.WARMING):
                upstream.state = TierState.UNHEALTHY
            interval = self.config.health_interval_s
            if upstream.state == TierState.WARMING or (
                process is not None and upstream.state == TierState.STARTING
            ):
                interval = min(interval, _STARTING_PROBE_S)
            with contextlib.suppress(asyncio.TimeoutError):
                # Wake at once when the process dies, else poll health at the interval.
                waiter = process.wait() if process is not None else asyncio.sleep(3600)
                await asyncio.wait_for(waiter, interval)
