"""The evaluation harness: play held-out tasks against any OpenAI-compatible chat endpoint.

One client path serves every target: a remote server (ours, the gateway, vLLM) over HTTP, or
any client the caller opens (training serves a checkpoint in process through the tier's own
FastAPI app over an ASGI transport: `training/reports/evaluation.py`), so what is measured is what
users get. The model's raw text is rebuilt from the parsed response
(`reasoning_content` back into <think>, `tool_calls` back into <tool_call> blocks) and fed to
the domain's episode, which verifies it. `--reference` plays the reference solutions instead,
which must score 100%: a check of the verifiers themselves.
"""

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from tasks import Domain, Style, Task, get_domain
from tasks.answers import reasoning_block, tool_call_block
from tasks.seeds import eval_seed

MAX_TURNS = 24  # a guard on top of each domain's own step limit


@dataclass
class Turn:
    text: str
    output_tokens: int | None
    latency_s: float


Policy = Callable[[Task, list[dict[str, Any]], int], Awaitable[Turn]]


def assistant_text(message: dict[str, Any]) -> str:
    """The text the model wrote, rebuilt from an OpenAI chat message."""
    parts = []
    if message.get("reasoning_content"):
        parts.append(reasoning_block(message["reasoning_content"]))
    parts.append(message.get("content") or "")
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        try:
            arguments = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            arguments = fn["arguments"]
        block = json.dumps({"name": fn["name"], "arguments": arguments}, ensure_ascii=False)
        parts.append("\n" + tool_call_block(block))
    return "".join(parts)


def chat_policy(
    client: httpx.AsyncClient, model: str, max_tokens: int, temperature: float
) -> Policy:
    """Ask an OpenAI-compatible server; `client.base_url` is its API root (ending in /v1)."""

    async def policy(task: Task, messages: list[dict[str, Any]], turn: int) -> Turn:
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        if task.tools:
            body["tools"] = task.tools
        start = time.monotonic()
        response = await client.post("chat/completions", json=body)
        latency = time.monotonic() - start
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        data = response.json()
        text = assistant_text(data["choices"][0]["message"])
        return Turn(text, data["usage"]["completion_tokens"], latency)

    return policy


def reference_policy(domains: dict[str, Domain], style: Style) -> Policy:
    async def policy(task: Task, messages: list[dict[str, Any]], turn: int) -> Turn:
        turns = domains[task.domain].reference(task, style)
        return Turn(turns[min(turn, len(turns) - 1)], None, 0.0)

    return policy


@dataclass
class Record:
    domain: str
    difficulty: int
    seed: int
    reward: float
    reason: str
    output_tokens: int | None
    latency_s: float
    metrics: dict[str, float] = field(default_factory=dict)
    # The first request of the episode, so a router can be trained on what it will see.
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    replies: list[str] = field(default_factory=list)  # what the policy wrote, turn by turn


async def play_episode(domain: Domain, task: Task, policy: Policy) -> Record:
    episode = domain.start(task)
    first_messages = [dict(m) for m in episode.messages]
    tokens: int | None = 0
    latency = 0.0
    replies = []
    try:
        for turn in range(MAX_TURNS):
            reply = await policy(task, episode.messages, turn)
            replies.append(reply.text)
            latency += reply.latency_s
            tokens = (
                None
                if reply.output_tokens is None or tokens is None
                else tokens + reply.output_tokens
            )
            if await asyncio.to_thread(episode.step, reply.text):  # may run a sandbox
                break
        verdict = episode.verdict()
        reward, reason, metrics = verdict.reward, verdict.reason, verdict.metrics
    except (RuntimeError, httpx.HTTPError) as e:
        reward, reason, metrics = 0.0, f"request failed: {e}", {}
    finally:
        episode.close()
    return Record(
        task.domain,
        task.difficulty,
        task.seed,
        reward,
        reason,
        tokens,
        latency,
        metrics,
        first_messages,
        task.tools,
        replies,
    )


async def evaluate(
    domains: dict[str, Domain],
    difficulties: Iterable[int],
    n: int,
    run_seed: int,
    policy: Policy,
    concurrency: int,
) -> list[Record]:
    """n held-out tasks per domain and difficulty, `concurrency` episodes at a time."""
    tasks = [
        domain.generate(eval_seed(run_seed, i), difficulty)
        for domain in domains.values()
        for difficulty in difficulties
        for i in range(n)
    ]
    return await play_tasks(domains, tasks, policy, concurrency)


async def play_tasks(
    domains: dict[str, Domain], tasks: list[Task], policy: Policy, concurrency: int
) -> list[Record]:
    """Play `tasks` (each of a domain in `domains`), `concurrency` episodes at a time; the
    records in the tasks' order."""
    gate = asyncio.Semaphore(concurrency)
    progress = tqdm(total=len(tasks), desc="eval", unit="task")

    async def one(task: Task) -> Record:
        async with gate:
            record = await play_episode(domains[task.domain], task, policy)
        progress.update()
        return record

    try:
        return list(await asyncio.gather(*(one(t) for t in tasks)))
    finally:
        progress.close()


def _mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its normal 95% interval."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, 1.96 * math.sqrt(var / n)


def wilson(successes: int, n: int) -> tuple[float, float]:
    """Wilson 95% interval for a rate: sound at 0% and 100%, unlike the normal one."""
    z = 1.96
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(records: list[Record]) -> list[dict[str, Any]]:
    """One row per (domain, difficulty), then one per domain over all difficulties."""
    groups: dict[tuple[str, int | str], list[Record]] = {}
    for r in records:
        groups.setdefault((r.domain, r.difficulty), []).append(r)
        groups.setdefault((r.domain, "all"), []).append(r)
    rows = []
    for (domain, difficulty), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))
    ):
        solved = sum(r.reward >= 1.0 for r in rs)
        low, high = wilson(solved, len(rs))
        tokens = [r.output_tokens for r in rs if r.output_tokens is not None]
        row = {
            "domain": domain,
            "difficulty": difficulty,
            "n": len(rs),
            "completion_rate": solved / len(rs),
            "completion_ci": [low, high],
            "mean_reward": _mean_ci([r.reward for r in rs]),
            "output_tokens": _mean_ci(tokens) if tokens else None,
            "latency_s": _mean_ci([r.latency_s for r in rs]),
        }
        steps = [r.metrics["steps"] for r in rs if "steps" in r.metrics]
        if steps:
            row["steps"] = _mean_ci(steps)
        invalid = [
            r.metrics["invalid_ops"] / max(r.metrics.get("steps", 1), 1)
            for r in rs
            if "invalid_ops" in r.metrics
        ]
        if invalid:
            row["invalid_op_rate"] = _mean_ci(invalid)  # invalid turns / turns, per episode
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    def pm(value: tuple[float, float] | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value[0]:.{digits}f} ± {value[1]:.{digits}f}"

    lines = [
        "| domain | difficulty | n | completion % (95% CI) | mean reward | output tokens "
        "| steps | invalid-op rate | latency s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        low, high = r["completion_ci"]
        lines.append(
            f"| {r['domain']} | {r['difficulty']} | {r['n']} | {100 * r['completion_rate']:.0f} "
            f"({100 * low:.0f}-{100 * high:.0f}) | {pm(r['mean_reward'], 2)} "
            f"| {pm(r['output_tokens'])} | {pm(r.get('steps'))} "
            f"| {pm(r.get('invalid_op_rate'), 2)} | {pm(r['latency_s'], 2)} |"
        )
    return "\n".join(lines)


def regressions(rows: list[dict[str, Any]], baseline: dict[str, Any], max_drop: float) -> list[str]:
    """Domains whose completion rate fell more than `max_drop` points below the baseline's."""
    before = {r["domain"]: r for r in baseline["summary"] if r["difficulty"] == "all"}
    failures = []
    for r in rows:
        old = before.get(r["domain"])
        if r["difficulty"] != "all" or old is None:
            continue
        drop = 100 * (old["completion_rate"] - r["completion_rate"])
        if drop > max_drop:
            failures.append(
                f"{r['domain']}: {100 * r['completion_rate']:.1f}% vs baseline "
                f"{100 * old['completion_rate']:.1f}% (-{drop:.1f} points > {max_drop})"
            )
    return failures


def report(records: list[Record]) -> dict[str, Any]:
    return {"summary": summarize(records), "records": [asdict(r) for r in records]}


async def run(
    domain_names: list[str],
    difficulties: list[int],
    n: int,
    run_seed: int,
    concurrency: int,
    *,
    client: httpx.AsyncClient | None = None,
    url: str | None = None,
    served_model: str | None = None,
    api_key: str | None = None,
    reference: Style | None = None,
    max_tokens: int = 512,
    temperature: float = 0.0,
) -> list[Record]:
    """Evaluate one target: an open client, a server by URL, or the references."""
    domains = {name: get_domain(name) for name in domain_names}
    if reference is not None:
        policy = reference_policy(domains, reference)
        return await evaluate(domains, difficulties, n, run_seed, policy, concurrency)
    if client is not None:
        policy = chat_policy(client, served_model or "", max_tokens, temperature)
        return await evaluate(domains, difficulties, n, run_seed, policy, concurrency)
    if url is None:
        raise ValueError("evaluate a client, a url or the references")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as opened:
        policy = chat_policy(opened, served_model or "", max_tokens, temperature)
        return await evaluate(domains, difficulties, n, run_seed, policy, concurrency)
