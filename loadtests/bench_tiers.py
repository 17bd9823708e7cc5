"""The two tiers side by side through the gateway: end-to-end latency, output tokens per
answer, output tokens/s per stream and completion, on the eval mix of the four domains.

Each tier plays the same held-out tasks (`tierserve eval`'s harness, greedy, one episode at a
time, so tokens/s is per stream) through a running `tierserve serve`; the tiers alternate
within each round so slow periods of a noisy machine hit both. A multi-turn episode's latency
and tokens are summed over its turns.

    tierserve serve &   # then
    python loadtests/bench_tiers.py [--url http://127.0.0.1:8000/v1] [--n 5] [--rounds 2]
"""

import argparse
import asyncio

from tasks import DEFAULT_DOMAINS
from tasks.harness import Record, run

TIERS = ("full", "highspeed")


def figures(records: list[Record]) -> dict[str, float]:
    latency = sum(r.latency_s for r in records)
    tokens = sum(r.output_tokens or 0 for r in records)
    first = [r for r in records if r.difficulty == 1]
    return {
        "latency": latency / len(records),
        "tokens": tokens / len(records),
        "tok_s": tokens / latency,
        "done": 100 * sum(r.reward >= 1.0 for r in records) / len(records),
        "done_d1": 100 * sum(r.reward >= 1.0 for r in first) / max(1, len(first)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--n", type=int, default=5, help="tasks per domain and difficulty")
    parser.add_argument("--seed", type=int, default=0, help="held-out run seed")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    records: dict[str, list[Record]] = {tier: [] for tier in TIERS}
    for round_ in range(args.rounds):
        for tier in TIERS if round_ % 2 == 0 else TIERS[::-1]:
            episodes = run(
                list(DEFAULT_DOMAINS), [1, 2, 3], args.n, args.seed, 1, url=args.url,
                served_model=tier,
            )  # fmt: skip
            records[tier] += asyncio.run(episodes)
    f = {tier: figures(records[tier]) for tier in TIERS}
    print(f"{len(records['full'])} episodes per tier ({args.rounds} rounds), greedy, one stream")
    print("| tier | latency s | output tokens | tok/s per stream | completion % | difficulty 1 % |")
    print("|---|---|---|---|---|---|")
    for tier in TIERS:
        x = f[tier]
        print(
            f"| {tier} | {x['latency']:.2f} | {x['tokens']:.1f} | {x['tok_s']:.0f} | "
            f"{x['done']:.0f} | {x['done_d1']:.0f} |"
        )
    full, fast = f["full"], f["highspeed"]
    print(
        f"\nhighspeed latency {full['latency'] / fast['latency']:.2f}x lower (target >= 2.5x); "
        f"tok/s per stream {fast['tok_s'] / full['tok_s']:.2f}x (target >= 2x); "
        f"difficulty 1 {fast['done_d1'] - full['done_d1']:+.0f} points (target >= -3)"
    )


if __name__ == "__main__":
    main()
