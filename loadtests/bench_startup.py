"""How long a tier takes to serve at full speed: `tierserve engine` from spawn to its first
/health 200 (ready: its one-row decode step compiled, `serving/model/graphs/decode.py`), with
an empty compile cache (cold) and then the one that start left (warm); and whether ready
means full speed: one stream's tokens/s on the first five requests after ready (their median),
while the larger graphs still compile in a process of their own, against the median of five
five minutes after the start, every size loaded by then (full speed: within 10%), and the
time to every size. Each request has a prompt of its own, so none is served from the prefix
cache.

This virtual machine alone moves one stream's speed by a third within minutes, more than the
10% asked, so each median is taken side by side with a reference: a second `tierserve engine`
on the same checkpoint, started first and fully compiled, whose requests alternate with the
measured tier's. While the reference serves, the measured tier and its compile process are
stopped (SIGSTOP), so the reference has the machine to itself, as the tier has (it holds its
compile process under a lone stream). Full speed is then the first median over the later,
each over the reference's beside it; the raw ratio is printed too.

`--speculative-config JSON` gives every engine (the reference's too) vLLM's speculative
decoding flag: a drafter's graphs compile after the target's, and until one is in the tier
decodes without drafts, so its first requests are plain decoding's against drafting later.

`--kill` then starts `tierserve serve` over two tiers of the checkpoint, waits for the steady
state (both tiers' every graph size in, the full tier's standby past its imports), puts the
server under load, SIGKILLs the full tier and times its recovery: from the kill to the
gateway's /health saying the tier is ready again; then its one-stream speed right away and a
minute later, each beside the highspeed tier's (the same checkpoint, up all along), as above.
`--kill-only` runs only that.

Each run has a cache directory of its own (inductor's caches and the C++ extension that
`kernels/cpu_attention.py` builds), so cold is cold and no other checkout's builds interfere.

    python -m loadtests.bench_startup [--checkpoint DIR] [--dtype float32] [--kill | --kill-only]
        [--speculative-config '{"method": "mtp", "num_speculative_tokens": 4}'] [--logs DIR]
"""

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import httpx
import psutil
import yaml

from loadtests.bench_engine import build_checkpoint
from serving.gateway.loadtest import wait_ready
from serving.gateway.upstream import free_port

PROMPT = " ".join(["tokens"] * 127)
NEW_TOKENS = 128
FULL_SPEED = 0.9  # the first requests' tokens/s at least this share of the later ones'
SPEED_REQUESTS = 5  # one speed: their median
_prompts = count()


def prompt() -> str:
    """A prompt no earlier request began with: each request prefills all of it."""
    return f"{next(_prompts)} {PROMPT}"


def cache_env(cache: Path, threads: int) -> dict[str, str]:
    return dict(
        os.environ,
        TIERSERVE_CACHE_DIR=str(cache),
        TORCH_EXTENSIONS_DIR=str(cache / "torch_extensions"),
        OMP_NUM_THREADS=str(threads),
    )


def tokens_per_s(root: str, model: str) -> float:
    """One greedy stream of NEW_TOKENS, generated tokens over the request's wall time."""
    body = {"model": model, "prompt": prompt(), "max_tokens": NEW_TOKENS, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    start = time.monotonic()
    response = httpx.post(f"{root}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"] / (time.monotonic() - start)


def alternating(speed: Callable[[], float], beside: Callable[[], float]) -> tuple[float, float]:
    """The medians of SPEED_REQUESTS requests of each, in turn."""
    pairs = [(speed(), beside()) for _ in range(SPEED_REQUESTS)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def process_tree(pid: int) -> list[psutil.Process]:
    """`pid` and the processes below it, from the top."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


# What a process stopped by SIGSTOP reports, or one that exited meanwhile.
STILL = {psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD}
STOP_TIMEOUT_S = 10.0  # how long a process sent SIGSTOP may take to report stopped


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process and every process below it stopped (SIGSTOP), continued after. Stopped
    from the top, again until no new one appears: a stopped parent starts no child. A signal
    is delivered a moment after it is sent, so this yields once each one reports stopped;
    one that has not within STOP_TIMEOUT_S (a process that ignores no SIGSTOP, so a wedged
    kernel or a traced process) fails the bench by name instead of hanging it."""
    done: list[psutil.Process] = []
    try:
        while new := [p for p in process_tree(pid) if p not in done]:
            for p in new:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.suspend()
                done.append(p)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in done:
            with contextlib.suppress(psutil.NoSuchProcess):
                while (status := p.status()) not in STILL:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"process {p.pid} was sent SIGSTOP and is still {status!r} "
                            f"after {STOP_TIMEOUT_S:.0f} s"
                        )
                    time.sleep(0.001)
        yield
    finally:
        for p in reversed(done):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.resume()


@dataclass(frozen=True)
class Tier:
    """What every engine of a run serves, and how."""

    checkpoint: Path
    dtype: str
    threads: int
    speculative: dict | None  # `--speculative-config`, as vLLM's


@dataclass
class Reference:
    """A warm engine whose speed, taken beside a tier's, tells the machine's from the tier's."""

    root: str

    def beside(self, root: str, pid: int) -> tuple[float, float]:
        """The medians of SPEED_REQUESTS requests to `root` (the server `pid`) and as many to
        the reference, alternating; the server stopped while the reference serves."""

        def reference() -> float:
            with stopped(pid):
                return tokens_per_s(self.root, "bench")

        return alternating(lambda: tokens_per_s(root, "bench"), reference)


@contextlib.contextmanager
def reference_engine(tier: Tier, cache: Path, log: Path) -> Iterator[Reference]:
    """The reference: spawned, every graph size compiled, one request served."""
    server, root = spawn_engine(tier, cache, log)
    try:
        wait_ready(root, 900, server, log)
        while "warmup" in httpx.get(f"{root}/health", timeout=5).json():
            time.sleep(0.5)
        tokens_per_s(root, "bench")
        yield Reference(root)
    finally:
        server.terminate()
        server.wait(60)


def spawn_engine(tier: Tier, cache: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-c", "from serving.cli import main; main()", "engine"]
    command += ["--model", str(tier.checkpoint), "--port", str(port), "--dtype", tier.dtype]
    command += ["--served-model-name", "bench"]
    if tier.speculative is not None:
        command += ["--speculative-config", json.dumps(tier.speculative)]
    with log.open("w") as out:
        env = cache_env(cache, tier.threads)
        server = subprocess.Popen(command, stdout=out, stderr=out, env=env)
    return server, f"http://127.0.0.1:{port}"


def start_tier(
    tier: Tier, cache: Path, log: Path, later_s: float, reference: Reference
) -> dict[str, float]:
    """Spawn to /health 200 (ready: one stream at full speed), the one-stream speed right
    after it and `later_s` after the spawn, each beside the reference's, every graph size
    loaded by then, and spawn to that (the larger ones compiled apart,
    `serving/engine/compile_process.py`; /health without `warmup`)."""
    begin = time.monotonic()
    server, root = spawn_engine(tier, cache, log)
    try:
        wait_ready(root, 900, server, log)
        ready = time.monotonic() - begin
        first, ref_first = reference.beside(root, server.pid)  # the larger graphs compiling
        while "warmup" in httpx.get(f"{root}/health", timeout=5).json():
            time.sleep(0.5)
        all_sizes = time.monotonic() - begin
        time.sleep(max(0.0, begin + later_s - time.monotonic()))
        # Unmeasured: after minutes idle, this virtual machine's first request runs slower
        # whatever serves it (its memory, warmed again).
        tokens_per_s(root, "bench")
        tokens_per_s(reference.root, "bench")
        later, ref_later = reference.beside(root, server.pid)
    finally:
        server.terminate()
        server.wait(60)
    return {"ready_s": ready, "first": first, "later": later, "all_s": all_sizes,
            "ref_first": ref_first, "ref_later": ref_later}  # fmt: skip


class Load(threading.Thread):
    """Back-to-back short requests through the gateway, alternating tiers, until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.statuses = url, threading.Event(), []

    def run(self) -> None:
        models = ["full", "highspeed"]
        while not self.stop.is_set():
            body = {"model": models[len(self.statuses) % 2], "prompt": prompt(), "max_tokens": 16}
            try:
                status = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60).status_code
            except httpx.HTTPError:
                status = 0
            self.statuses.append(status)


def full_tier(url: str) -> dict:
    """The full tier's entry in the gateway's /health."""
    return httpx.get(f"{url}/health", timeout=5).json()["tiers"]["full"]


def steady(url: str) -> bool:
    """Whether the gateway is in the state a kill should find: every graph size of both tiers
    in (before, the replacement would go on compiling the rest beside its first requests; the
    tiers run one thread each, and inductor generates a graph's kernels for a thread count, so
    theirs are not the ones the bench's two-thread starts cached) and the full tier's standby
    past its imports (before, the replacement waits for the rest of them)."""
    tiers = httpx.get(f"{url}/health", timeout=5).json()["tiers"]
    return tiers["full"]["standby_ready"] and not any("warmup" in t for t in tiers.values())


def kill_under_load(tier: Tier, cache: Path, workdir: Path, later_s: float) -> dict[str, float]:
    """Recovery from a SIGKILL of the full tier under load, then one stream on it right away
    and `later_s` after, each beside the highspeed tier (the same checkpoint, up all along)
    as the reference."""
    engine = {"model": str(tier.checkpoint), "dtype": tier.dtype, "threads": 1}
    if tier.speculative is not None:
        engine["speculative"] = tier.speculative
    port = free_port()
    config = {
        "port": port,
        "tiers": {"full": engine | {"served_model_name": "bench-full"},
                  "highspeed": engine | {"served_model_name": "bench-fast"}},
        "supervisor": {"restart_backoff_s": 0.5},
    }  # fmt: skip
    path = workdir / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    log = workdir / "serve.log"
    command = [sys.executable, "-c", "from serving.cli import main; main()", "serve"]
    with log.open("w") as out:
        gateway = subprocess.Popen(
            [*command, "--config", str(path)], stdout=out, stderr=out, env=cache_env(cache, 1)
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 900, gateway, log)
        while not steady(url):
            time.sleep(0.5)
        pid = full_tier(url)["pid"]
        loads = [Load(url) for _ in range(4)]
        for load in loads:
            load.start()
        time.sleep(5)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while True:
            full = full_tier(url)
            if full["state"] == "healthy" and full["pid"] != pid:
                recovery = time.monotonic() - killed
                break
            time.sleep(0.05)
        for load in loads:
            load.stop.set()
            load.join(120)

        def speed(tier: str) -> Callable[[], float]:
            return lambda: tokens_per_s(url, tier)

        first, ref_first = alternating(speed("full"), speed("highspeed"))
        time.sleep(later_s)
        later, ref_later = alternating(speed("full"), speed("highspeed"))
    finally:
        gateway.terminate()
        gateway.wait(120)
    statuses = [s for load in loads for s in load.statuses]
    failed = sum(s != 200 for s in statuses)
    return {"recovery_s": recovery, "first": first, "later": later, "ref_first": ref_first,
            "ref_later": ref_later, "requests": len(statuses), "failed": failed}  # fmt: skip


def verdict(first: float, later: float) -> str:
    ratio = first / later
    return f"{ratio:.2f} ({'full speed' if ratio >= FULL_SPEED else 'NOT full speed'})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/tierserve-bench-moe-43m"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--threads", type=int, default=2, help="the tier's (a machine busy with other work: 1)"
    )
    ap.add_argument("--kill", action="store_true", help="also SIGKILL a tier under load")
    ap.add_argument("--kill-only", action="store_true", help="only that (its cache warmed first)")
    ap.add_argument(
        "--kill-later-s", type=float, default=60, help="when after recovery full speed is measured"
    )
    ap.add_argument(
        "--later-s", type=float, default=300, help="when after the spawn full speed is measured"
    )
    ap.add_argument(
        "--speculative-config", type=json.loads, metavar="JSON", help="every engine's, as vLLM's"
    )
    ap.add_argument("--logs", type=Path, help="keep every server's log here (default: dropped)")
    args = ap.parse_args()
    checkpoint = build_checkpoint(args.checkpoint)
    tier = Tier(checkpoint, args.dtype, args.threads, args.speculative_config)
    with tempfile.TemporaryDirectory() as tmp:
        cache, logs = Path(tmp) / "cache", args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        reference_cache = cache if args.kill_only else Path(tmp) / "reference-cache"
        with reference_engine(tier, reference_cache, logs / "reference.log") as reference:
            starts = ("cold", "warm") if not args.kill_only else ()
            rows = [
                (n, start_tier(tier, cache, logs / f"engine-{n}.log", args.later_s, reference))
                for n in starts
            ]
        killed = None
        if args.kill or args.kill_only:
            killed = kill_under_load(tier, cache, logs, args.kill_later_s)
    spec = f" --speculative-config '{json.dumps(tier.speculative)}'" if tier.speculative else ""
    print(f"\n`tierserve engine --model {checkpoint.name} --dtype {args.dtype}{spec}`, "
          f"{args.threads} threads; "
          f"one stream: {NEW_TOKENS} new tokens, greedy")  # fmt: skip
    print(f"| cache | spawn to ready (/health 200) s | first {SPEED_REQUESTS} requests tok/s "
          f"(median; the reference's beside) | tok/s {args.later_s:.0f} s after spawn (median "
          f"of {SPEED_REQUESTS}; the reference's beside) | first / later, raw | first / later, "
          "each over the reference's | spawn to every graph size in s |\n"
          "|---|---|---|---|---|---|---|")  # fmt: skip
    for name, row in rows:
        first, later = row["first"] / row["ref_first"], row["later"] / row["ref_later"]
        print(f"| {name} | {row['ready_s']:.1f} | {row['first']:.0f} ({row['ref_first']:.0f}) | "
              f"{row['later']:.0f} ({row['ref_later']:.0f}) | "
              f"{row['first'] / row['later']:.2f} | {verdict(first, later)} | "
              f"{row['all_s']:.1f} |")  # fmt: skip
    if killed:
        k = killed
        first, later = k["first"] / k["ref_first"], k["later"] / k["ref_later"]
        print(f"\nSIGKILL of the full tier under load (`tierserve serve`, two tiers, 1 thread "
              f"each, killed in the steady state): back ready in "
              f"{k['recovery_s']:.1f} s; then one stream {k['first']:.0f} tok/s (the highspeed "
              f"tier's beside: {k['ref_first']:.0f}) against {k['later']:.0f} "
              f"({k['ref_later']:.0f}) {args.kill_later_s:.0f} s later: raw "
              f"{k['first'] / k['later']:.2f}, each over the highspeed tier's "
              f"{verdict(first, later)}; {k['requests']} requests under load, "
              f"{k['failed']} failed")  # fmt: skip


if __name__ == "__main__":
    main()
