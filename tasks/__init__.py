"""Verifiable tasks: the chat tiers' four domains (math, code, terminal, tool calling) and
long-context retrieval, with their verifiers, the sandbox their code runs in, and the
evaluation harness that plays them.

The registry is the public interface: `DOMAINS` maps each name to its domain object, and
`get_domain` refuses an unknown name with the list of known ones. The command line, the load
tests, the data builders, the router's outcome labels and the trainer all go through it.
`DEFAULT_DOMAINS` names the domains that are used where none are named (training's data mix
and evaluations, the load tests' request mix, `tierserve eval tasks`): the chat tiers' own.
Retrieval is registered but not among them, since its prompts are long logs that the chat
tiers are not trained or sized for; a config or a command names it to use it.
"""

from typing import Any

from tasks.base import Domain, Episode, Style, Task
from tasks.code import CodeDomain
from tasks.math import MathDomain
from tasks.retrieval import RetrievalDomain
from tasks.terminal import TerminalDomain
from tasks.tools import ToolsDomain

DOMAINS: dict[str, Domain] = {
    domain.name: domain
    for domain in (MathDomain(), CodeDomain(), TerminalDomain(), ToolsDomain(), RetrievalDomain())
}
DEFAULT_DOMAINS: tuple[str, ...] = ("math", "code", "terminal", "tools")


def opening_requests(per_kind: int, seed: int = 0) -> list[dict[str, Any]]:
    """Each default domain's easy (difficulty 1) and hard (difficulty 3) tasks as their first chat
    request, system prompt and tools included, exactly as `tierserve eval tasks` starts them:
    `[{"kind": "math-easy", "messages": [...], "tools": [...] | None}, ...]`."""
    requests = []
    for name in DEFAULT_DOMAINS:
        domain = DOMAINS[name]
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


__all__ = [
    "DEFAULT_DOMAINS",
    "DOMAINS",
    "Domain",
    "Episode",
    "Style",
    "Task",
    "get_domain",
    "opening_requests",
]
