"""Continuous batching: which sequences run this step, and how many tokens each.

Every sequence simply has tokens still to compute: a whole prompt, the rest of a prompt
(chunked prefill), or the one token sampled last step (decode), followed by its
speculative drafts if it has any (cut first when the budget runs short). Running
sequences are served first within a per-step token budget, those past their prompt before
those still prefilling (so a long prompt takes what the decodes leave, one chunk a step,
and never stalls a stream), oldest first within each; waiting ones are
admitted in arrival order while budget, sequence slots and cache blocks last. When the
cache runs out the newest running sequence is preempted: its blocks are freed and it is
recomputed later (its full blocks usually survive in the prefix cache, which makes that
cheap). A hybrid model's sequences also need a DeltaNet state slot to run
(`state_slots.py`): admission takes one with the blocks, preemption and finishing give it
back.

Samples of one request (n > 1) share its prompt's computation. With a prefix cache, the
others wait until the first has computed the prompt, then find its blocks in the cache. A
hybrid model has no prefix cache (a block's keys are not enough without the DeltaNet state at
its end), so the first stops one token short of its prompt's end (`Sequence.fork_at`), and
the others fork there: its full blocks shared, its partly filled block and its state slot
copied (`Fork`), before the step in which each computes the last prompt token itself. A
sample that cannot be admitted at that step computes its prompt alone later.
"""

from collections import deque
from dataclasses import dataclass, field

from serving.engine.block_manager import BlockManager
from serving.engine.sequence import Sequence, SequenceStatus
from serving.engine.state_slots import StateSlots


@dataclass
class Fork:
    """What the model runner copies before a step's forward pass for a sample that forks."""

    parent_slot: int
    child_slot: int
    block_copies: list[tuple[int, int]]  # (source, destination) KV blocks


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        state_slots: StateSlots | None = None,
    ) -> None:
        self.blocks = block_manager
        self.state_slots = state_slots  # a hybrid model's; None for the others
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=lambda seq: not seq.prompt_done)  # stable: oldest first in each
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            uncomputed = _uncomputed(seq)
            n = min(uncomputed + len(seq.draft_token_ids), budget)
            if n - uncomputed < len(seq.draft_token_ids):  # the budget cuts into the drafts
                seq.draft_token_ids = seq.draft_token_ids[: max(0, n - uncomputed)]
                if seq.draft_probs is not None:
                    seq.draft_probs = seq.draft_probs[: len(seq.draft_token_ids)]
            while not self.blocks.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        blocked: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            leader = seq.prefill_leader
            waits = leader is not None and not leader.is_finished and not leader.prompt_done
            forks = waits and leader.num_computed_tokens == leader.fork_at
            if waits and not forks:
                blocked.append(seq)  # wait to share the leader's prompt blocks
                continue
            if self.state_slots is not None and not self.state_slots.allocate(seq):
                self.waiting.appendleft(seq)
                break
            seq.prefill_leader = None
            copies = self.blocks.fork(leader, seq, leader.fork_at) if forks else None
            if forks and copies is None:
                self._release(seq)
                self.waiting.appendleft(seq)
                break
            if copies is None and not seq.block_table:
                self.blocks.match_prefix(seq)
            n = min(_uncomputed(seq), budget)
            if not self.blocks.allocate_slots(seq, n):
                self._release(seq)
                self.waiting.appendleft(seq)
                break
            if copies is not None:
                out.forks.append(Fork(leader.state_slot, seq.state_slot, copies))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(blocked))

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.clear_drafts()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence (finished or aborted) wherever it is."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Its KV blocks, and its state slot if it holds one."""
        self.blocks.free_sequence(seq)
        if self.state_slots is not None:
            self.state_slots.release(seq)


def _uncomputed(seq: Sequence) -> int:
    """Tokens it has yet to compute, up to its fork point while it has not reached it."""
    end = len(seq)
    if seq.fork_at is not None and seq.num_computed_tokens < seq.fork_at:
        end = seq.fork_at
    return end - seq.num_computed_tokens
