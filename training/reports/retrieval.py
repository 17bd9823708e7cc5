"""Long-context retrieval by length and depth: the retrieval domain's held-out tasks at chosen
log lengths (the rows) and needle depths (the columns), played through the eval harness against
a checkpoint served in process by the tier's own app, so the table is what a client of the
served model gets. Each row gives its prompts' length in the model's tokens, the chat template
applied as the server applies it, beside the lines that make them.
"""

from dataclasses import asdict
from pathlib import Path
from typing import Any

from serving.model.tokenizer import Tokenizer
from tasks import harness
from tasks.base import Task
from tasks.retrieval import DEPTHS, STATUSES, RetrievalDomain
from tasks.seeds import eval_seed
from training.reports.evaluation import SERVED_MODEL, served_client

DEFAULT_LINES = (16, 48, 128)
DEFAULT_DEPTHS = DEPTHS


def retrieval_tasks(lines: list[int], depths: list[float], n: int, run_seed: int = 0) -> list[Task]:
    """n held-out tasks for each (lines, depth) cell, rows first."""
    domain = RetrievalDomain()
    return [
        domain.generate_at(eval_seed(run_seed, i), length, depth)
        for length in lines
        for depth in depths
        for i in range(n)
    ]


async def evaluate_retrieval(
    model_dir: str | Path, tasks: list[Task], concurrency: int, max_tokens: int
) -> list[harness.Record]:
    """Greedy answers of `model_dir`, served in process, to `tasks`: records in their order."""
    async with served_client(model_dir) as client:
        policy = harness.chat_policy(client, SERVED_MODEL, max_tokens, 0.0)
        domains = {"retrieval": RetrievalDomain()}
        return await harness.play_tasks(domains, tasks, policy, concurrency)


def prompt_tokens(tokenizer: Tokenizer, task: Task) -> int:
    """The prompt's length as the server counts it: the chat template applied."""
    messages = [{"role": "user", "content": task.prompt}]
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages)))


def summarize(
    tasks: list[Task], records: list[harness.Record], tokenizer: Tokenizer
) -> list[dict[str, Any]]:
    """One row per log length: its mean prompt tokens, then accuracy at each depth and over
    all depths (with its Wilson 95% interval)."""
    rows: dict[int, dict[str, Any]] = {}
    for task, record in zip(tasks, records, strict=True):
        row = rows.setdefault(task.data["lines"], {"tokens": [], "depths": {}})
        row["tokens"].append(prompt_tokens(tokenizer, task))
        cell = row["depths"].setdefault(task.data["depth"], [0, 0])
        cell[0] += record.reward >= 1.0
        cell[1] += 1
    out = []
    for lines, row in rows.items():
        solved = sum(s for s, _ in row["depths"].values())
        n = sum(c for _, c in row["depths"].values())
        out.append(
            {
                "lines": lines,
                "prompt_tokens": sum(row["tokens"]) / len(row["tokens"]),
                "by_depth": {d: {"solved": s, "n": c} for d, (s, c) in row["depths"].items()},
                "solved": solved,
                "n": n,
                "ci": wilson_pct(solved, n),
            }
        )
    return out


def wilson_pct(solved: int, n: int) -> list[float]:
    low, high = harness.wilson(solved, n)
    return [100 * low, 100 * high]


def format_table(rows: list[dict[str, Any]]) -> str:
    depths = list(rows[0]["by_depth"])
    head = " | ".join(f"depth {d:.2f}" for d in depths)
    lines = [
        f"| lines | prompt tokens | {head} | all (95% CI) |",
        "|---" * (len(depths) + 3) + "|",
    ]
    for r in rows:
        cells = " | ".join(
            f"{100 * c['solved'] / c['n']:.0f}% ({c['solved']}/{c['n']})"
            for c in r["by_depth"].values()
        )
        low, high = r["ci"]
        all_ = f"{100 * r['solved'] / r['n']:.0f}% ({low:.0f}-{high:.0f})"
        lines.append(f"| {r['lines']} | {r['prompt_tokens']:.0f} | {cells} | {all_} |")
    lines.append(f"\nchance: {100 / len(STATUSES):.1f}% (one of {len(STATUSES)} status codes)")
    return "\n".join(lines)


def report(
    tasks: list[Task], records: list[harness.Record], tokenizer: Tokenizer
) -> dict[str, Any]:
    return {
        "summary": summarize(tasks, records, tokenizer),
        "records": [
            {k: v for k, v in asdict(r).items() if k != "messages"}  # the logs: left out
            | {"lines": t.data["lines"], "depth": t.data["depth"]}
            for t, r in zip(tasks, records, strict=True)
        ],
    }
