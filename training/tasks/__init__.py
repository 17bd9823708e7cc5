"""Verifiable tasks: four domains (math, code, terminal, tool calling) with their verifiers,
the sandbox their code runs in, and the evaluation harness that plays them.

The registry is the public interface: `DOMAINS` maps each name to its domain object, and
`get_domain` refuses an unknown name with the list of known ones. The command line, the load
tests, the data builders, the router's outcome labels and the trainer all go through it.
"""

from training.tasks.base import Domain, Episode, Style, Task
from training.tasks.code import CodeDomain
from training.tasks.math import MathDomain
from training.tasks.terminal import TerminalDomain
from training.tasks.tools import ToolsDomain

DOMAINS: dict[str, Domain] = {
    domain.name: domain for domain in (MathDomain(), CodeDomain(), TerminalDomain(), ToolsDomain())
}


def get_domain(name: str) -> Domain:
    try:
        return DOMAINS[name]
    except KeyError:
        raise ValueError(f"unknown domain {name!r}; choose from {', '.join(DOMAINS)}") from None


__all__ = ["DOMAINS", "Domain", "Episode", "Style", "Task", "get_domain"]
