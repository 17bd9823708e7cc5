"""What every task domain provides: seeded tasks, reference solutions and a verifier.

A task is played as an episode: the conversation so far goes to a model (or to the reference
solution), its answer is fed back with `Episode.step`, and the domain decides when the
episode is over and how well it went. Single-turn domains end after one answer; terminal
and multi-turn tool tasks answer each turn with an observation.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

from tasks.answers import split_reasoning

Style = Literal["think", "short"]  # full tier: <think> trace then answer; highspeed: short answers
MIN_DIFFICULTY, MAX_DIFFICULTY = 1, 3


@dataclass(frozen=True)
class Task:
    domain: str
    seed: int
    difficulty: int
    prompt: str  # the first user message
    data: dict[str, Any]  # what the verifier needs: the answer, hidden tests, a file tree...
    tools: list[dict[str, Any]] | None = None  # OpenAI `tools` for tool-calling tasks


@dataclass
class Verdict:
    reward: float  # in [0, 1]
    reason: str
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. steps, invalid_ops


class Episode(ABC):
    """One attempt at a task. `messages` is the conversation in OpenAI chat format."""

    def __init__(self, task: Task, system: str | None = None) -> None:
        self.task = task
        self.messages: list[dict[str, Any]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.messages.append({"role": "user", "content": task.prompt})
        self.done = False

    @abstractmethod
    def step(self, completion: str) -> bool:
        """Feed the assistant's turn (raw text, may hold <think> and <tool_call> blocks);
        append it and any observation to `messages`; return True when the episode is over."""

    @abstractmethod
    def verdict(self) -> Verdict:
        """Score the episode (also valid when it was cut short)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the episode holds (a sandbox directory)."""


class SingleAnswerEpisode(Episode):
    """One answer, then the verdict: the episode of a domain that asks one question."""

    def __init__(self, task: Task, system: str | None = None) -> None:
        super().__init__(task, system)
        self.completion: str | None = None

    def step(self, completion: str) -> bool:
        reasoning, content = split_reasoning(completion)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        self.messages.append(message)
        self.completion, self.done = completion, True
        return True

    def verdict(self) -> Verdict:
        if self.completion is None:
            return Verdict(0.0, "no answer")
        return self.score(self.completion)

    @abstractmethod
    def score(self, completion: str) -> Verdict:
        """The verdict on the answer the model gave (its raw text)."""


class Domain(ABC):
    name: str
    checks_working = False  # whether `first_error` can find a false step

    @abstractmethod
    def generate(self, seed: int, difficulty: int) -> Task:
        """The same (seed, difficulty) always gives the same task."""

    @abstractmethod
    def reference(self, task: Task, style: Style) -> list[str]:
        """The assistant turns of a correct solution, in the given style."""

    @abstractmethod
    def start(self, task: Task) -> Episode: ...

    def reasons(self, style: Style) -> bool:
        """Whether a reference answer in `style` opens with a reasoning block."""
        return style == "think"

    def first_error(self, task: Task, completion: str) -> tuple[int, int] | None:
        """The character span of the first step of an answer's working that the domain shows
        wrong on its own, without the final verdict; None where it shows none (or has no
        such check). RL puts the blame for a failed answer there."""
        return None

    def drill(self, seed: int, difficulty: int) -> str | None:
        """A pretraining document of the domain's own, for a skill a solved task's text
        teaches too rarely to be learned from it; None: pretraining reads solved tasks."""
        return None


def play(domain: Domain, task: Task, turns: list[str]) -> tuple[Episode, Verdict]:
    """Run an episode with scripted assistant turns (a reference solution, a test)."""
    episode = domain.start(task)
    try:
        for turn in turns:
            if episode.step(turn):
                break
        return episode, episode.verdict()
    finally:
        episode.close()
