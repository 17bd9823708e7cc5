"""Speculative decoding's totals, counted as vLLM reports them."""

from dataclasses import dataclass, field


@dataclass
class SpecCounts:
    """Speculative decoding totals of a sequence, a request or the engine."""

    num_drafts: int = 0  # verification steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)  # steps by drafts kept

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        hist = self.acceptance_histogram
        hist.extend([0] * (num_accepted + 1 - len(hist)))
        hist[num_accepted] += 1

    def merge(self, other: "SpecCounts") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        hist = self.acceptance_histogram
        hist.extend([0] * (len(other.acceptance_histogram) - len(hist)))
        for i, n in enumerate(other.acceptance_histogram):
            hist[i] += n

    @property
    def accepted_per_position(self) -> list[int]:
        """How often the draft at each position was kept (position i: steps keeping > i)."""
        hist = self.acceptance_histogram
        return [sum(hist[i + 1 :]) for i in range(len(hist) - 1)]
