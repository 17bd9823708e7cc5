"""When to speculate and how far: drafts for the next step, chosen after each step.

Speculation pays when drafts are accepted and the engine has compute to spare. Per
request, the lookahead k maximises expected tokens per unit of step cost: with per-token
acceptance a, a step with k drafts yields 1 + a + ... + a^k tokens and costs 1 + f + c k
plain decode steps. f is what speculating costs at all: verifying (a sparse model's k + 1
tokens route to more experts than one token does) and, for MTP, running the MTP layer over
the step's tokens; c is what each draft adds. Both are measured on this CPU with the demo
models by `loadtests/bench_speculative.py --costs`.
a is estimated per request from its accepted and rejected drafts, decayed so it follows
the text. A request whose best k is 0 stops speculating and probes with one draft every
`PROBE_EVERY` steps. Steps with more running requests than `disable_by_batch_size` do
not speculate at all: a full batch already keeps the hardware busy, and verifying drafts
would only add work.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from speculative.config import SpeculativeConfig
from speculative.counts import SpecCounts
from speculative.proposer import DraftSequence, Proposer, TargetStep


@dataclass(frozen=True)
class StepCost:
    """A speculative step's cost beyond a plain decode step, in plain decode steps."""

    fixed: float  # f above
    per_draft: float  # c above


COSTS = {
    "ngram": StepCost(fixed=0.7, per_draft=0.0),
    "mtp": StepCost(fixed=0.9, per_draft=0.2),
    "draft": StepCost(fixed=0.7, per_draft=0.26),
}
PROBE_EVERY = 8
_DECAY = 0.8
_PRIOR = (3.0, 1.0)  # (accepted, rejected) before any evidence: a = 0.75, worth a try


class SpeculatedSequence(DraftSequence, Protocol):
    """What the speculator reads of a running sequence besides what drafters do."""

    constraint: object | None  # a constrained (JSON, tool call) sequence decodes alone
    spec: SpecCounts  # the request's totals

    @property
    def num_output_tokens(self) -> int: ...

    def clear_drafts(self) -> None: ...


@dataclass
class _Acceptance:
    accepted: float = _PRIOR[0]
    rejected: float = _PRIOR[1]
    idle_steps: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


def best_lookahead(rate: float, cost: StepCost, max_k: int) -> int:
    """argmax over k of (1 + a + ... + a^k) / (1 + f + c k), or 0."""
    best, best_value, expected = 0, 1.0, 1.0
    for k in range(1, max_k + 1):
        expected += rate**k
        value = expected / (1 + cost.fixed + cost.per_draft * k)
        if value > best_value:
            best, best_value = k, value
    return best


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.cost = COSTS[config.method]
        self.stats = SpecCounts()  # engine totals, exported as Prometheus counters
        self.acceptance: dict[int, _Acceptance] = {}

    @staticmethod
    def speculable(seq: SpeculatedSequence) -> bool:
        """Requests whose next-token distribution depends on more than the model and the
        sampling filters (penalties, EOS masked by min_tokens, constrained JSON) are
        decoded one token at a time."""
        p = seq.params
        return (
            seq.constraint is None
            and not p.uses_penalties
            and seq.num_output_tokens >= p.min_tokens
        )

    def lookahead(self, seq: SpeculatedSequence) -> int:
        state = self.acceptance.setdefault(seq.seq_id, _Acceptance())
        k = best_lookahead(state.rate, self.cost, self.config.num_speculative_tokens)
        if k == 0:
            state.idle_steps += 1
            k = 1 if state.idle_steps % PROBE_EVERY == 0 else 0
        # Drafts past max_tokens are never emitted; positions past the context never exist.
        left = min(seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - len(seq))
        return max(0, min(k, left))

    def record(self, seq: SpeculatedSequence, num_drafts: int, num_accepted: int) -> None:
        seq.spec.add(num_drafts, num_accepted)
        self.stats.add(num_drafts, num_accepted)
        state = self.acceptance.setdefault(seq.seq_id, _Acceptance())
        state.accepted = _DECAY * state.accepted + num_accepted
        state.rejected = _DECAY * state.rejected + (num_accepted < num_drafts)

    @torch.inference_mode()
    def propose(self, step: TargetStep, running: list[SpeculatedSequence]) -> None:
        """Drafts for the next step of every running sequence that will decode."""
        for seq in running:
            seq.clear_drafts()
        busy = (
            self.config.disable_by_batch_size and len(running) > self.config.disable_by_batch_size
        )
        if busy or not self.proposer.ready():
            self.proposer.pause(step)
            return
        seqs, ks = [], []
        for seq in running:
            if seq.num_computed_tokens == len(seq) - 1 and self.speculable(seq):
                k = self.lookahead(seq)
                if k:
                    seqs.append(seq)
                    ks.append(k)
        self.proposer.propose(seqs, ks, step)

    def release(self, seq: SpeculatedSequence) -> None:
        self.acceptance.pop(seq.seq_id, None)
        self.proposer.release(seq)
