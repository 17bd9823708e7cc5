"""Verifiable tasks: four domains (math, code, terminal, tool calling) with their verifiers,
the sandbox their code runs in, and the evaluation harness that plays them.

The registry is the public interface: `DOMAINS` maps each name to its domain object, and
`get_domain` refuses an unknown name with the list of known ones. The command line, the load
tests, the data builders, the router's outcome labels and the trainer all go through it.
"""

from typing import Any

from tasks.base import Domain, Episode, Style, Task
from tasks.code import CodeDomain
from tasks.math import MathDomain
from tasks.terminal import TerminalDomain
from tasks.tools import ToolsDomain

DOMAINS: dict[str, Domain] = {
    domain.name: domain for domain in (MathDomain(), CodeDomain(), TerminalDomain(), ToolsDomain())
}


def opening_requests(per_kind: int, seed: int = 0) -> list[dict[str, Any]]:
    """Each domain's easy (difficulty 1) and hard (difficulty 3) tasks as their first chat
    request, system prompt and tools included, exactly as `tierserve eval tasks` starts them:
    `[{"kind": "math-easy", "messages": [...], "tools": [...] | None}, ...]`."""
    requests = []
    for name, domain in DOMAINS.items():
        for difficulty, label in ((1, "easy"), (3, "hard")):
            for i in range(per_kind):
                task = domain.generate(seed * 1000 + i, difficulty)
                episode = domain.start(task)
                messages = list(episode.messages)
                episode.close()
                requests.append(
                    {"kind": f"{name}-{label}", "messages": messages, "tools": task.tools}
                )
    return requests


def get_domain(name: str) -> Domain:
    try:
        return DOMAINS[name]
    except KeyError:
        raise ValueError(f"unknown domain {name!r}; choose from {', '.join(DOMAINS)}") from None


__all__ = ["DOMAINS", "Domain", "Episode", "Style", "Task", "get_domain", "opening_requests"]
