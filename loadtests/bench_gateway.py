"""What the gateway costs: the same requests through `tierserve serve` and directly to its
tier, at concurrency 1 and 32, in one run.

One `tierserve serve` process supervises two embedded tiers on one checkpoint (a fresh
random one unless --model says otherwise; 1 torch thread each), or, with --canned, fronts
two remote tiers that answer at once, so what remains is the cost of the hop itself. The
router runs on every request (the heuristic with threshold 0, so every request is scored
and lands on the full tier, which is also the tier asked directly). Requests are greedy
with `ignore_eos`, so both paths do exactly the same work.

- concurrency 1: each request is sent directly, through the gateway and directly again (in a
  rotating order); the added latency is the per-request difference (p50, p99), so drift in
  machine load cancels, and the direct-direct difference shows the noise floor (A/A).
- concurrency N: direct and gateway phases alternate (twice each); throughput is output
  tokens over wall time, the added latency the difference of the two distributions, and
  the two direct phases compared with each other give the noise floor.

With --canned, `loadtests/bare_proxy.py` (a raw ASGI app relaying bytes over aiohttp, nothing
else) runs beside the gateway in front of the same tier and takes its turn at concurrency 1
too: what it adds is the floor of a Python hop on this machine, measured in the same run as
the gateway (this machine's speed moves by 2x between spells).

Also prints the gateway's own overhead histogram (parse, route, annotate) and the router's
cost per request. Run:

    python loadtests/bench_gateway.py [--model DIR | --canned] [--stream] [--max-tokens 32]
"""

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from router.features import route_request
from router.heuristic import HeuristicPolicy
from serving.gateway.loadtest import LoadTestError, wait_ready
from serving.gateway.upstream import free_port

WORDS = "the quick brown fox jumps over a lazy dog while counting 17 * 23 apples".split()  # noqa: SIM905


Job = tuple[str, int]  # a prompt and its max_tokens


def make_jobs(n: int, max_tokens: int, seed: int = 0) -> list[Job]:
    """Prompts of 8-64 words, each asking for max_tokens / 2 to 3 * max_tokens / 2 tokens (so
    requests finish at different steps, as real traffic does)."""
    rng = random.Random(seed)
    return [
        (" ".join(rng.choices(WORDS, k=rng.randint(8, 64))),
         rng.randint(max_tokens // 2, 3 * max_tokens // 2))
        for _ in range(n)
    ]  # fmt: skip


def start_gateway(tier: dict, workdir: Path) -> tuple[subprocess.Popen, str, str]:
    """`tierserve serve` with both tiers configured as `tier` (distinct model names)."""
    port = free_port()
    names = {"full": "bench-full", "highspeed": "bench-fast"}
    key = "model" if tier["engine"] == "remote" else "served_model_name"
    config = {
        "port": port,
        "tiers": {t: tier | {key: name} for t, name in names.items()},
        "router": {"policy": "heuristic", "threshold": 0.0, "spill": {"enabled": False}},
    }
    path = workdir / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (workdir / "gateway.log").open("w")
    command = [sys.executable, "-c", "from serving.cli import main; main()", "serve"]
    process = subprocess.Popen([*command, "--config", str(path)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 600, process, workdir / "gateway.log")
    except LoadTestError as e:
        process.terminate()
        raise SystemExit(str(e)) from None
    health = httpx.get(f"{url}/health", timeout=5).json()
    return process, url, health["tiers"]["full"]["url"].removesuffix("/v1")


def start_bare_proxy(tier_root: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    script = Path(__file__).with_name("bare_proxy.py")
    command = [sys.executable, str(script), "--port", str(port), "--upstream", tier_root]
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            httpx.get(f"{url}/health", timeout=2).raise_for_status()
            return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit("the bare proxy did not start")


class Target:
    def __init__(self, name: str, root: str, model: str, client: httpx.AsyncClient) -> None:
        self.name, self.url, self.model, self.client = (
            name,
            f"{root}/v1/chat/completions",
            model,
            client,
        )

    async def request(self, job: Job, stream: bool) -> tuple[float, int]:
        """Latency in seconds and output tokens of one request."""
        prompt, max_tokens = job
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
        start = time.perf_counter()
        if stream:
            async with self.client.stream("POST", self.url, json=body) as response:
                response.raise_for_status()
                async for _ in response.aiter_raw():
                    pass
        else:
            response = await self.client.post(self.url, json=body)
            response.raise_for_status()
        return time.perf_counter() - start, max_tokens


async def phase(
    target: Target, jobs: list[Job], concurrency: int, stream: bool
) -> tuple[list[float], int, float]:
    """Latencies, output tokens and wall time of the jobs at `concurrency`."""
    queue = list(reversed(jobs))
    latencies: list[float] = []
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            latency, n = await target.request(queue.pop(), stream)
            latencies.append(latency)
            tokens += n

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, tokens, time.perf_counter() - start


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def overhead_seconds(url: str) -> tuple[float, float]:
    """Count and sum of the gateway's own overhead histogram."""
    text = httpx.get(f"{url}/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("tierserve_gateway_overhead_seconds_"):
                values[s.name.rsplit("_", 1)[1]] = s.value
    return values["count"], values["sum"]


def router_cost_us(jobs: list[Job]) -> tuple[float, float]:
    policy = HeuristicPolicy()
    timings = []
    for prompt, _ in jobs * 20:
        start = time.perf_counter()
        policy.score(route_request({"messages": [{"role": "user", "content": prompt}]}))
        timings.append(time.perf_counter() - start)
    return 1e6 * percentile(timings, 50), 1e6 * percentile(timings, 99)


@dataclass
class Row:
    concurrency: int
    direct: list[float]  # latencies, s
    gateway: list[float]
    added: tuple[float, float]  # p50, p99 of what the gateway adds, s
    noise: tuple[float, float]  # the same measured between two direct runs (A/A), s
    throughput: tuple[float, float]  # direct, gateway tok/s
    noise_ratio: float  # throughput of one direct run over the other
    floor: tuple[float, float] | None = None  # p50, p99 of what the bare proxy adds, s


async def sequential(
    direct: Target, gateway: Target, bare: Target | None, jobs: list[Job], stream: bool
) -> Row:
    """Concurrency 1: each job direct, through the gateway (and the bare proxy), and direct
    again, in a rotating order; differences within a job cancel drift in machine load."""
    runs: list[dict[str, float]] = []
    for i, job in enumerate(jobs):
        order = [("direct", direct), ("gateway", gateway), ("again", direct)]
        order += [("bare", bare)] if bare else []
        order = order[i % len(order) :] + order[: i % len(order)]
        runs.append({name: (await target.request(job, stream))[0] for name, target in order})
    tokens = sum(n for _, n in jobs)
    added = [r["gateway"] - r["direct"] for r in runs]
    noise = [r["again"] - r["direct"] for r in runs]
    floor = [r["bare"] - r["direct"] for r in runs] if bare else None

    def tput(name: str) -> float:
        return tokens / sum(r[name] for r in runs)

    return Row(
        1,
        [r["direct"] for r in runs],
        [r["gateway"] for r in runs],
        (percentile(added, 50), percentile(added, 99)),
        (percentile(noise, 50), percentile(noise, 99)),
        (tput("direct"), tput("gateway")),
        tput("again") / tput("direct"),
        floor and (percentile(floor, 50), percentile(floor, 99)),
    )


async def alternating(
    direct: Target, gateway: Target, jobs: list[Job], concurrency: int, stream: bool, pid: int
) -> tuple[Row, float]:
    """Concurrency N: direct and gateway phases alternate, twice each. Also returns the
    gateway process's CPU seconds per request."""
    phases: dict[str, list[tuple[list[float], int, float]]] = {"direct": [], "gateway": []}
    cpu = 0.0
    for _ in range(2):
        for target in (direct, gateway):
            before = cpu_seconds(pid)
            phases[target.name].append(await phase(target, jobs, concurrency, stream))
            if target is gateway:
                cpu += cpu_seconds(pid) - before
    lat = {k: [x for p in v for x in p[0]] for k, v in phases.items()}
    tput = {k: sum(p[1] for p in v) / sum(p[2] for p in v) for k, v in phases.items()}
    (first, n1, t1), (second, n2, t2) = phases["direct"]
    row = Row(
        concurrency,
        lat["direct"],
        lat["gateway"],
        tuple(percentile(lat["gateway"], q) - percentile(lat["direct"], q) for q in (50, 99)),
        tuple(percentile(second, q) - percentile(first, q) for q in (50, 99)),
        (tput["direct"], tput["gateway"]),
        (n2 / t2) / (n1 / t1),
    )  # type: ignore[arg-type]
    return row, cpu / len(lat["gateway"])


async def bench(
    args: argparse.Namespace, url: str, tier_root: str, gateway_pid: int, bare_url: str | None
) -> None:
    # Idle connections expire before the servers' 5 s keep-alive closes them.
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256, keepalive_expiry=2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        direct = Target("direct", tier_root, "bench-full", client)
        gateway = Target("gateway", url, "auto", client)
        bare = Target("bare", bare_url, "bench-full", client) if bare_url else None
        jobs = make_jobs(args.requests, args.max_tokens)
        for target in (direct, gateway, bare):  # warm up
            if target is not None:
                await phase(target, jobs[:4], 4, args.stream)
        rows, cpu_per_request = [], None
        for concurrency in args.concurrency:
            if concurrency == 1:
                pairs = jobs[: args.pairs]
                rows.append(await sequential(direct, gateway, bare, pairs, args.stream))
            else:
                row, cpu_per_request = await alternating(
                    direct, gateway, jobs, concurrency, args.stream, gateway_pid
                )
                rows.append(row)
    mode = "streaming" if args.stream else "whole responses"
    mode += " from canned tiers (the hop alone)" if args.canned else " from engine tiers"
    print(
        f"\n{mode}, {args.max_tokens // 2}-{3 * args.max_tokens // 2} output tokens per "
        "request, greedy; A/A: the same figure between two direct runs (the noise floor)"
        + ("; bare proxy: what loadtests/bare_proxy.py adds (the floor)" if bare_url else "")
        + "\n"
    )
    print(
        "| concurrency | direct p50 ms | gateway p50 ms | added p50 ms (A/A) | added p99 ms "
        "(A/A) | bare proxy added p50 / p99 ms | direct tok/s | gateway tok/s "
        "| throughput ratio (A/A) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        floor = f"{1000 * r.floor[0]:.2f} / {1000 * r.floor[1]:.2f}" if r.floor else "-"
        print(
            f"| {r.concurrency} | {1000 * percentile(r.direct, 50):.1f} "
            f"| {1000 * percentile(r.gateway, 50):.1f} "
            f"| {1000 * r.added[0]:.2f} ({1000 * r.noise[0]:.2f}) "
            f"| {1000 * r.added[1]:.2f} ({1000 * r.noise[1]:.2f}) | {floor} "
            f"| {r.throughput[0]:.0f} | {r.throughput[1]:.0f} "
            f"| {r.throughput[1] / r.throughput[0]:.3f} ({r.noise_ratio:.3f}) |"
        )
    count, total = overhead_seconds(url)
    p50, p99 = router_cost_us(jobs)
    print(
        f"\ngateway's own overhead (parse, route, annotate): mean {1e6 * total / count:.0f} µs "
        f"over {count:.0f} requests; router alone p50 {p50:.0f} µs, p99 {p99:.0f} µs"
    )
    if cpu_per_request is not None:
        print(
            "gateway process CPU (uvicorn, FastAPI, httpx, routing): "
            f"{1000 * cpu_per_request:.2f} ms per request at concurrency > 1"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint (default: a fresh random one)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests", type=int, default=128, help="per phase at concurrency N")
    parser.add_argument("--pairs", type=int, default=48, help="requests at concurrency 1")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stream", action="store_true", help="stream the answers")
    parser.add_argument(
        "--canned",
        action="store_true",
        help="tiers that answer at once instead of engines: the hop's cost alone",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        children = []
        if args.canned:
            port = free_port()
            canned = Path(__file__).with_name("canned_tier.py")
            command = [sys.executable, str(canned), "--port", str(port)]
            children.append(subprocess.Popen(command))
            tier = {"engine": "remote", "base_url": f"http://127.0.0.1:{port}/v1"}
        else:
            from training.stages.init_checkpoint import init_checkpoint

            model = args.model or init_checkpoint(workdir / "bench-moe")
            tier = {"engine": "embedded", "model": str(model), "threads": 1}
        process, url, tier_root = start_gateway(tier, workdir)
        children.insert(0, process)
        bare_url = None
        if args.canned:
            bare, bare_url = start_bare_proxy(tier_root)
            children.append(bare)
        try:
            asyncio.run(bench(args, url, tier_root, process.pid, bare_url))
        finally:
            for child in children:
                os.kill(child.pid, signal.SIGTERM)
                child.wait(timeout=60)


if __name__ == "__main__":
    main()
