"""The engine through the OpenAI API against the same engine offline, side by side in one run.

Starts `tierserve engine` on the benchmark checkpoint, then at each concurrency runs that many
client streams, each sending 2 streamed greedy `/v1/completions` requests one after the other
(prompts of 128 token ids, 128 new tokens, EOS ignored): the client of the llama-server
comparison in /work/shared/REFERENCE_FIGURES.md. The same prompts then run through an
`LLMEngine` in this process, stepped on a thread of its own as the server steps its engine
(the engine's offline figure). API and offline runs alternate, `--rounds` of each per
concurrency, so a slow minute of a shared machine hits both; the table gives the medians.
Prints generated tokens/s of both and their ratio (with its range over the rounds), mean
TTFT, inter-token latency p50/p99 (gaps between streamed chunks), and the server's startup
time to its first /health 200, which comes once one stream runs at full speed (both engines
compile every decode step size and the runs wait for them, unless `--enforce-eager`).

    python -m loadtests.bench_api [--concurrency 1 4 16] [--rounds 3] [--dtype float32]
"""

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import httpx
import orjson
import torch

from loadtests.bench_engine import build_checkpoint, make_prompts
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.gateway.loadtest import LoadTestError, wait_ready
from serving.model.checkpoint import load_checkpoint
from serving.model.dtype import DTYPES
from serving.model.host_threads import build_off_thread
from serving.sampling.params import SamplingParams

PROMPT_TOKENS = 128
REQUESTS_PER_STREAM = 2


def start_server(
    path: Path,
    port: int,
    dtype: str,
    threads: int,
    log: Path,
    eager: bool,
    extra: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, float]:
    """The server (`tierserve engine`, and `extra` flags) and its startup time: spawn to the
    first /health 200, which it answers once one stream runs at full speed. Returned once
    nothing is left to compile (`warm`): before, steps of several sequences run in chunks of
    the one-row graph, and a run of several streams would measure the warm-up."""
    command = [sys.executable, "-c", "from serving.cli import main; main()", "engine"]
    command += ["--model", str(path), "--port", str(port), "--dtype", dtype]
    command += ["--served-model-name", "bench"]
    command += ["--max-num-seqs", "64", "--max-num-batched-tokens", "1024"]
    command += ["--enforce-eager"] if eager else []
    command += extra
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 900, proc, log)
    except LoadTestError as e:
        proc.terminate()
        raise SystemExit(str(e)) from None
    ready = time.monotonic() - start
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if warm(httpx.get(f"{url}/health", timeout=2)):
                return proc, ready
        if proc.poll() is not None or time.monotonic() - start > 900:
            proc.terminate()
            raise SystemExit(f"the server did not finish compiling; see {log}")
        time.sleep(0.5)


def warm(health: httpx.Response) -> bool:
    """200 and nothing compiling: our engine answers 200 once one stream runs at full speed,
    with a `warmup` body while its other batch sizes still compile in the background."""
    if health.status_code != 200:
        return False
    with contextlib.suppress(ValueError):  # vLLM's 200 has no body
        return "warmup" not in health.json()
    return True


async def one_request(
    session: aiohttp.ClientSession, url: str, prompt: list[int], new: int, gaps: list[float]
) -> tuple[int, float]:
    """Tokens generated (the usage chunk's count) and time to the first chunk; appends the
    gaps between later chunks (vLLM's inter-token latency: a chunk may carry several)."""
    body = dict(
        model="bench",
        prompt=prompt,
        max_tokens=new,
        temperature=0.0,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    start = time.monotonic()
    tokens, ttft, last = 0, None, start
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            data = orjson.loads(line[6:])
            now = time.monotonic()
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            if not data["choices"]:
                continue
            if ttft is None:
                ttft = now - start
            else:
                gaps.append(now - last)
            last = now
    return tokens, ttft


async def run_api(port: int, prompts: list[list[int]], new: int, fresh: bool = False) -> dict:
    """The streams through aiohttp, as vLLM's serving benchmark sends them: the client shares
    the server's 2 cores, and httpx's line reader cost 3-4x the CPU a chunk. `fresh`: a new
    connection a request (llama-server closes one after a streamed answer while announcing
    keep-alive, and the next request on it fails)."""
    gaps: list[float] = []
    ttfts: list[float] = []
    url = f"http://127.0.0.1:{port}"
    connector = aiohttp.TCPConnector(limit=len(prompts) + 4, force_close=fresh)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def stream(prompt: list[int]) -> int:
            total = 0
            for _ in range(REQUESTS_PER_STREAM):
                n, ttft = await one_request(session, url, prompt, new, gaps)
                total += n
                ttfts.append(ttft)
            return total

        start = time.monotonic()
        counts = await asyncio.gather(*(stream(p) for p in prompts))
        wall = time.monotonic() - start
    gaps.sort()
    return dict(
        tps=sum(counts) / wall,
        ttft=statistics.mean(ttfts),
        itl_p50=gaps[len(gaps) // 2],
        itl_p99=gaps[int(len(gaps) * 0.99)],
    )


def run_offline(engine: LLMEngine, prompts: list[list[int]], new: int) -> float:
    """Generated tokens/s, each prompt run twice in a row as the API's streams do.

    The engine steps on a thread of its own, as in the server (`AsyncEngine`), so the two
    figures differ only by the API layer. It matters with 2 torch threads on shared cores:
    stepped on the main thread, OpenMP's worker spins between parallel regions and the
    engine collapsed (6 tok/s at 4 streams, both threads at 100% CPU, against 220 tok/s on
    a thread of its own, its worker at 0.2 s of CPU a run)."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    generated = 0

    def run() -> None:
        nonlocal generated
        for _ in range(REQUESTS_PER_STREAM):
            outs = engine.generate(prompts, params)
            generated += sum(len(o[0].token_ids) for o in outs)

    thread = threading.Thread(target=run, name="engine")
    start = time.monotonic()
    thread.start()
    thread.join()
    return generated / (time.monotonic() - start)


def median_row(concurrency: int, apis: list[dict], offlines: list[float]) -> dict:
    """One table row from alternating rounds: the median of each figure, and the range of
    the rounds' API / offline ratios (how far to trust the median's)."""
    ratios = [a["tps"] / o for a, o in zip(apis, offlines, strict=True)]
    row = {k: statistics.median(a[k] for a in apis) for k in apis[0]}
    offline = statistics.median(offlines)
    return row | dict(
        concurrency=concurrency, offline=offline, ratio=row["tps"] / offline, ratios=ratios
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/tierserve-bench-moe-43m"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=3, help="API and offline runs of each")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8317)
    ap.add_argument("--enforce-eager", action="store_true", help="both engines eager")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = build_checkpoint(args.checkpoint)
    log = Path(tempfile.mkdtemp()) / "engine.log"
    eager = args.enforce_eager
    server, startup = start_server(path, args.port, args.dtype, args.threads, log, eager)
    engine = build_off_thread(  # as the server builds its own (`serving/model/host_threads.py`)
        lambda: LLMEngine(
            load_checkpoint(path, DTYPES[args.dtype]),
            EngineConfig(max_num_seqs=64, max_num_batched_tokens=1024, enforce_eager=eager),
            eos_token_ids=[],
        )
    )
    if not eager:
        engine.runner.paged.graphs.wait()
    vocab = engine.model.config.vocab_size
    rows = []
    try:
        warm = make_prompts(2, vocab, seed=99)
        asyncio.run(run_api(args.port, [p[:PROMPT_TOKENS] for p in warm], 8))
        run_offline(engine, [p[:PROMPT_TOKENS] for p in warm], 8)
        for c in args.concurrency:
            prompts = [p[:PROMPT_TOKENS] for p in make_prompts(c, vocab, seed=c)]
            apis, offlines = [], []
            for _ in range(args.rounds):
                apis.append(asyncio.run(run_api(args.port, prompts, args.new_tokens)))
                offlines.append(run_offline(engine, prompts, args.new_tokens))
            rows.append(median_row(c, apis, offlines))
    finally:
        server.terminate()
        server.wait()
    print(
        f"\n{path.name}, {args.dtype}, {args.threads} threads: streamed greedy /v1/completions, "
        f"{PROMPT_TOKENS}-token prompts, {args.new_tokens} new tokens, {REQUESTS_PER_STREAM} "
        f"requests per stream; {args.rounds} rounds of each, medians; "
        f"{'eager' if eager else 'compiled'}; server startup to /health "
        f"200 (ready): {startup:.1f} s"
    )
    print(
        "| streams | API tok/s | offline tok/s | API / offline (rounds) | TTFT ms | ITL p50 ms "
        "| ITL p99 ms | p99 / p50 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        spread = f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f}"
        print(
            f"| {r['concurrency']} | {r['tps']:.0f} | {r['offline']:.0f} | {r['ratio']:.2f} "
            f"({spread}) | {r['ttft'] * 1e3:.0f} | {r['itl_p50'] * 1e3:.1f} "
            f"| {r['itl_p99'] * 1e3:.1f} | {r['itl_p99'] / r['itl_p50']:.1f} |"
        )


if __name__ == "__main__":
    main()
