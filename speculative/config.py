"""`--speculative-config`: the same JSON as vLLM's, for the methods we implement."""

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# vLLM's names for the same methods, accepted so a vLLM config works unchanged.
_ALIASES = {"draft_model": "draft", "deepseek_mtp": "mtp", "[ngram]": "ngram"}


class SpeculativeConfig(BaseModel):
    """`{"method": "draft"|"mtp"|"ngram", "model": DIR, "num_speculative_tokens": k}`.

    `num_speculative_tokens` is the most drafts per step; each request adapts its own
    lookahead below it from its acceptance (see `speculative.speculator`).
    `disable_by_batch_size`: no speculation in steps with more running requests than this
    (vLLM's knob; speculation slows a busy engine down). `prompt_lookup_min/max`: the n-gram
    sizes that n-gram lookup matches, longest first.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["draft", "mtp", "ngram"]
    model: Path | None = None
    num_speculative_tokens: Annotated[int, Field(ge=1, le=16)] = 4
    disable_by_batch_size: Annotated[int, Field(ge=1)] | None = 4
    prompt_lookup_max: Annotated[int, Field(ge=1)] = 4
    prompt_lookup_min: Annotated[int, Field(ge=1)] = 2

    @field_validator("method", mode="before")
    @classmethod
    def _vllm_names(cls, value: object) -> object:
        return _ALIASES.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.method == "draft" and self.model is None:
            raise ValueError("method 'draft' needs `model`: the draft model's directory")
        if self.method != "draft" and self.model is not None:
            raise ValueError(f"method {self.method!r} takes no `model`")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self
