"""Speculative decoding through the OpenAI API: a tier's engine with and without its MTP
drafter, side by side in one run.

Starts `tierserve engine` twice on the target (default `models/demo-highspeed`, one thread
each, as the gateway runs a tier), one with `--speculative-config '{"method": "mtp"}'`, and
waits until both have compiled every step. Then sends held-out tasks of the four domains one
at a time with the official `openai` client, as a user writes them (chat messages and the
task's tools; the checkpoint's default sampling unless `--temperature`), the two servers
taking turns each round, each round on tasks of its own (a prompt seen before would hit the
prefix cache). Prints each round's output tokens/s (completion tokens over the
wall time) and the ratio of the medians. `bench_speculative.py` measures the engines alone;
through the server, drafts also spread its per-step costs over several tokens.

    python -m loadtests.bench_speculative_api [--requests 24] [--rounds 3] [--temperature T]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from openai import OpenAI

from loadtests.bench_api import start_server
from loadtests.bench_speculative import MODELS, held_out_tasks
from tasks import Task


def tokens_per_s(client: OpenAI, tasks: list[Task], temperature: float | None) -> float:
    sampling = {} if temperature is None else {"temperature": temperature}
    tokens, start = 0, time.monotonic()
    for task in tasks:
        tools = {"tools": task.tools} if task.tools else {}
        reply = client.chat.completions.create(
            model="bench",
            messages=[{"role": "user", "content": task.prompt}],
            max_tokens=256,
            **tools,
            **sampling,
        )
        tokens += reply.usage.completion_tokens
    return tokens / (time.monotonic() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=MODELS / "demo-highspeed")
    ap.add_argument("--requests", type=int, default=24, help="tasks a round, one at a time")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--temperature", type=float, help="default: the checkpoint's")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--port", type=int, default=8351)
    args = ap.parse_args()
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": args.k})
    flags = {"none": (), "mtp": ("--speculative-config", mtp)}
    tasks = held_out_tasks(1 + args.rounds * args.requests)
    speeds: dict[str, list[float]] = {name: [] for name in flags}
    with tempfile.TemporaryDirectory() as tmp:
        servers, clients = [], {}
        try:
            for i, (name, extra) in enumerate(flags.items()):
                port = args.port + i
                log = Path(tmp) / f"{name}.log"
                server, _ = start_server(
                    args.target, port, args.dtype, args.threads, log, False, extra
                )
                servers.append(server)
                clients[name] = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
            for client in clients.values():  # one request each before timing
                tokens_per_s(client, tasks[:1], args.temperature)
            for r in range(args.rounds):
                round_tasks = tasks[1 + r * args.requests : 1 + (r + 1) * args.requests]
                for name in list(flags)[:: 1 if r % 2 == 0 else -1]:
                    speed = tokens_per_s(clients[name], round_tasks, args.temperature)
                    speeds[name].append(speed)
                    print(f"round {r + 1}, {name}: {speeds[name][-1]:.0f} tok/s", flush=True)
        finally:
            for server in servers:
                server.terminate()
                server.wait()
    none, drafted = (statistics.median(speeds[name]) for name in flags)
    sampling = "the checkpoint's sampling" if args.temperature is None else args.temperature
    print(
        f"{args.target.name}, {args.requests} tasks one at a time, {args.rounds} rounds, "
        f"temperature {sampling}: MTP {drafted:.0f} tok/s / none {none:.0f} tok/s = "
        f"{drafted / none:.2f}x"
    )


if __name__ == "__main__":
    main()
