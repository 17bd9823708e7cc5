"""Training data from the task domains: pretraining text, SFT conversations, RL prompts.

Everything streams (generators, one task at a time) and is deterministic: the same domain,
difficulty and seed range always give the same data. Seeds come from the training space
(`training.seeds`), so no example can coincide with a held-out evaluation task.
"""

from collections.abc import Iterable, Iterator
from typing import Any

from training.domains.base import Domain, Style, Task, play
from training.seeds import train_seed


def tasks(domain: Domain, seeds: Iterable[int], difficulties: Iterable[int]) -> Iterator[Task]:
    """RL prompt sets: the tasks themselves (prompt, tools, and what the verifier needs)."""
    levels = list(difficulties)
    for seed in seeds:
        for difficulty in levels:
            yield domain.generate(train_seed(seed), difficulty)


def sft_examples(
    domain: Domain, seeds: Iterable[int], difficulties: Iterable[int], style: Style
) -> Iterator[dict[str, Any]]:
    """Chat-format SFT examples: the reference solution played through a real episode, so
    multi-turn tasks carry the true observations. Examples whose reference does not verify
    are a bug and raise rather of training the model on a wrong answer."""
    for task in tasks(domain, seeds, difficulties):
        episode, verdict = play(domain, task, domain.reference(task, style))
        if verdict.reward < 1.0:
            raise RuntimeError(f"{task.domain} seed {task.seed}: reference: {verdict.reason}")
        example: dict[str, Any] = {"messages": episode.messages, "domain": task.domain}
        if task.tools:
            example["tools"] = task.tools
        yield example


def pretrain_documents(
    domain: Domain, seeds: Iterable[int], difficulties: Iterable[int], style: Style
) -> Iterator[str]:
    """Plain-text documents (no chat markup): each turn's text, in order, blank-line separated."""
    for example in sft_examples(domain, seeds, difficulties, style):
        parts = []
        for message in example["messages"]:
            if message.get("content"):
                parts.append(message["content"])
            for call in message.get("tool_calls") or []:
                fn = call["function"]
                parts.append(f"{fn['name']}({fn['arguments']})")
        yield "\n\n".join(parts)
