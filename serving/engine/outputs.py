"""What the engine returns for a request each step: per-sequence deltas, mergeable into
the whole answer (vLLM's `RequestOutput` and `CompletionOutput`)."""

from dataclasses import dataclass, field

from serving.sampling.params import TokenLogprob
from speculative.counts import SpecCounts


@dataclass
class SequenceOutput:
    """What one of a request's n sequences produced: a delta per step, or accumulated."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    def extend(self, delta: "SequenceOutput") -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[SequenceOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the request's first output
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    spec: SpecCounts | None = None  # speculative decoding over its sequences, when finished

    def merge(self, later: "RequestOutput") -> "RequestOutput":
        """This output followed by a later one of the same request, as one (in place)."""
        mine = {o.index: o for o in self.outputs}
        for delta in later.outputs:
            if delta.index in mine:
                mine[delta.index].extend(delta)
            else:
                self.outputs.append(delta)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.spec = later.spec
        return self
