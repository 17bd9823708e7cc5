"""Per-request sampling settings, as vLLM's SamplingParams holds them (validated at the API
edge), and the log-probability reported for a token."""

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class SamplingParams:
    """What vLLM's SamplingParams holds, minus what nobody asked for.

    `top_k <= 0` and `top_p == 1` disable those filters; `temperature == 0` means greedy.
    `logprobs=None` returns no logprobs, `0` only the chosen token's, `k` also the top k.
    `json_object` constrains the output to a JSON object (`response_format` json_object);
    `tool_names` to exactly one tool call to one of those functions (`tool_choice`
    "required" or a named function), in the chat template's `<tool_call>` form; with
    `tool_call_optional` (`tool_choice` "auto") to text in which each call that starts
    is such a call; `tool_parameters` (name -> parameter schema) holds a call's arguments to
    its function's declared keys.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    json_object: bool = False
    tool_names: list[str] | None = None
    tool_call_optional: bool = False
    tool_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None  # (token id, logprob), best first


class Constraint(Protocol):
    """The tokens a constrained row may take next (structured outputs: a JSON object, a tool
    call); the engine keeps one per sequence and advances it with each token."""

    def allows(self, token_id: int) -> bool: ...
    def allowed_mask(self, vocab_size: int) -> torch.Tensor: ...


@dataclass
class SamplingRow:
    """One row of the batch: one sequence being decoded."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far, before this step
    generator: torch.Generator | None = None  # set when params.seed is not None
    constraint: Constraint | None = None  # the tokens it may take, if constrained
