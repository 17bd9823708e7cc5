"""One generated sequence: its tokens, its place in the KV cache and its progress."""

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from serving.engine.json_constraint import JsonObjectConstraint
from serving.model.device import CPU
from serving.sampling.params import SamplingParams, TokenLogprob
from speculative.counts import SpecCounts

_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    """A request with n > 1 becomes n sequences; index says which of them this is.

    `num_computed_tokens` counts tokens whose keys and values are in the cache; the
    scheduler moves it forward (chunked prefill) and back to 0 (preemption by recompute).
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    index: int = 0
    device: torch.device = CPU  # the engine's: a seeded request's generator draws there
    # A sibling whose prompt blocks this sequence waits for, to share them (n > 1).
    prefill_leader: "Sequence | None" = None
    # A hybrid model's leader of n > 1 computes its prompt up to here (the last token left),
    # where its siblings fork its cache and state (`Scheduler`).
    fork_at: int | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None  # a hybrid model's DeltaNet state slot while it runs
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    constraint: JsonObjectConstraint | None = None  # what it may sample next (json_object)
    # Speculative decoding: tokens proposed for the next step, to be verified after the
    # last token, and the drafter's distributions [k, V] they were drawn from (None when
    # proposed deterministically); then the request's totals, as vLLM reports them.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    spec: SpecCounts = field(default_factory=SpecCounts)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator(self.device).manual_seed(self.params.seed + self.index)

    def clear_drafts(self) -> None:
        self.draft_token_ids = []
        self.draft_probs = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def prompt_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens
