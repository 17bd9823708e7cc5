"""The OpenAI API's response and stream-chunk shapes, as vLLM writes them."""

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from serving.api_server.protocol import ToolCall

FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class SpecDecodeMetrics(BaseModel):
    """One request's speculative decoding, as vLLM reports it per request."""

    num_spec_tokens: int  # the configured most drafts per step
    num_spec_steps: int  # steps that verified drafts
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    draft_acceptance_rate: float  # accepted / drafted
    mean_acceptance_length: float  # tokens per verification step, the bonus token included
    acceptance_histogram: list[int]  # steps by number of drafts accepted


class ResponseMetrics(BaseModel):
    speculative_decoding: SpecDecodeMetrics


class _Response(BaseModel):
    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    # vLLM's per-request metrics beside `usage`; only from a tier that speculates.
    metrics: ResponseMetrics | None = None

    @model_serializer(mode="wrap")
    def _metrics_last(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """`metrics` after `usage`, as vLLM writes it, and only when there are some."""
        data = handler(self)
        metrics = data.pop("metrics", None)
        if metrics is not None:
            data["metrics"] = metrics
        return data


class _Choice(BaseModel):
    index: int
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that matched


class ChatCompletionChoice(_Choice):
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(_Choice):
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None  # only in the final chunk, with include_usage


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tierserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
