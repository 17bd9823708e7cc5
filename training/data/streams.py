"""Training data from the task domains: pretraining text, SFT conversations, RL prompts.

Everything streams (generators, one task at a time) and is deterministic: the same domain,
difficulty and seed range always give the same data. Seeds come from the training space
(`tasks.seeds`), so no example can coincide with a held-out evaluation task.
"""

import copy
import random
from collections.abc import Iterable, Iterator
from typing import Any

from tasks.base import Domain, Style, Task, Verdict
from tasks.seeds import train_seed
from training.data.code_pieces import CodePieces
from training.data.natural import naturalize


def tasks(domain: Domain, seeds: Iterable[int], difficulties: Iterable[int]) -> Iterator[Task]:
    """RL prompt sets: the tasks themselves (prompt, tools, and what the verifier needs)."""
    levels = list(difficulties)
    for seed in seeds:
        for difficulty in levels:
            yield domain.generate(train_seed(seed), difficulty)


def sft_examples(
    domain: Domain,
    seeds: Iterable[int],
    difficulties: Iterable[int],
    style: Style,
    natural: float = 0.0,
    codes: CodePieces | None = None,
) -> Iterator[dict[str, Any]]:
    """Chat-format SFT examples: the reference solution played through a real episode, so
    multi-turn tasks carry the true observations. Examples whose reference does not verify
    are a bug and raise rather than train the model on a wrong answer.

    `turns` pairs each assistant turn's raw text (what the model must generate) with the
    conversation before it (what it is prompted with): the chat template drops earlier
    turns' reasoning, so a multi-turn episode is trained one turn at a time, in exactly the
    context inference gives it.

    A share `natural` of the tasks get a reworded prompt, sometimes under a system prompt
    (`training.data.natural`); with `codes`, a share of the tool chains a code built from merged
    pieces (`training.data.code_pieces`)."""
    for task in tasks(domain, seeds, difficulties):
        system = None
        rng = random.Random(f"natural:{task.domain}:{task.seed}:{task.difficulty}")
        if rng.random() < natural:
            task, system = naturalize(task, rng)
        if codes is not None:
            task = codes.redraw(task, random.Random(f"codes:{task.seed}:{task.difficulty}"))
        # A second try: on a loaded machine a sandboxed command can hit its time limit.
        messages, turns, verdict = _play_reference(domain, task, system, style)
        if verdict.reward < 1.0:
            messages, turns, verdict = _play_reference(domain, task, system, style)
        if verdict.reward < 1.0:
            raise RuntimeError(f"{task.domain} seed {task.seed}: reference: {verdict.reason}")
        example: dict[str, Any] = {
            "messages": messages,
            "turns": turns,
            "domain": task.domain,
            "difficulty": task.difficulty,
        }
        if task.tools:
            example["tools"] = task.tools
        yield example


def _play_reference(
    domain: Domain, task: Task, system: str | None, style: Style
) -> tuple[list[dict[str, Any]], list[tuple[list[dict[str, Any]], str]], Verdict]:
    """The reference solution played through a real episode: the final conversation, each
    assistant turn with the conversation before it, and the verdict."""
    episode = domain.start(task)
    if system is not None:
        episode.messages.insert(0, {"role": "system", "content": system})
    turns: list[tuple[list[dict[str, Any]], str]] = []
    try:
        for turn in domain.reference(task, style):
            turns.append((copy.deepcopy(episode.messages), turn))
            if episode.step(turn):
                break
        return episode.messages, turns, episode.verdict()
    finally:
        episode.close()


def pretrain_documents(
    domain: Domain, seeds: Iterable[int], difficulties: Iterable[int], style: Style
) -> Iterator[str]:
    """Plain-text documents (no chat markup): each turn's text in order, blank-line separated,
    the assistant's turns as the model writes them (reasoning and tool-call blocks included)."""
    for example in sft_examples(domain, seeds, difficulties, style):
        raw = iter(turn for _, turn in example["turns"])
        parts = [
            next(raw) if message["role"] == "assistant" else message["content"]
            for message in example["messages"]
            if message["role"] == "assistant" or message.get("content")
        ]
        yield "\n\n".join(parts)
