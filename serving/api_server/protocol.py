"""The OpenAI API as vLLM accepts it: request validation (the responses: `responses.py`).

Unknown request fields are ignored (as OpenAI does), so clients written for newer API
versions still work. Unsupported features that would change the answer (`logit_bias`,
`suffix`, `best_of`) are rejected rather than silently dropped.
"""

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    model_validator,
)

from serving.sampling.params import SamplingParams

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


Content = str | list[TextPart]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextMessage(BaseModel):
    role: Literal["system", "developer", "user"]  # developer: OpenAI's new name for system
    content: Content
    name: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Content | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None


class ToolMessage(BaseModel):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ChatMessage = Annotated[TextMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object"]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by the chat and completions APIs (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    user: str | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @model_validator(mode="after")
    def _check_sampling(self) -> "SamplingRequest":
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    def _sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        defaults: Mapping[str, float],
        **extra: Any,
    ) -> SamplingParams:
        """Fields the request leaves unset take the checkpoint's recommended `defaults`
        (its generation_config.json, as vLLM applies it), else the neutral values."""

        def pick(name: str, neutral: float) -> Any:
            value = getattr(self, name)
            return defaults.get(name, neutral) if value is None else value

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=int(pick("top_k", 0)),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            seed=self.seed,
            logprobs=logprobs,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            min_tokens=min(self.min_tokens, max_tokens),
            ignore_eos=self.ignore_eos,
            n=self.n,
            skip_special_tokens=self.skip_special_tokens,
            **extra,
        )


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM's chat extras: variables for the template (e.g. enable_thinking=False).
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError(f"tool_choice {self.tool_choice!r} requires tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {tool.function.name for tool in self.tools or []}:
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return self

    def to_sampling_params(
        self, default_max_tokens: int, defaults: Mapping[str, float]
    ) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        json_object = (
            self.response_format is not None and self.response_format.type == "json_object"
        )
        # Constrained decoding: "required" and a named function force one call; "auto" (the
        # default with tools) holds each call the model starts to the offered names, unless
        # the output must be a JSON object.
        tool_names = None
        if isinstance(self.tool_choice, NamedToolChoice):
            tool_names = [self.tool_choice.function.name]
        elif self.tool_choice == "required" or (
            self.tools and self.tool_choice in (None, "auto") and not json_object
        ):
            tool_names = [tool.function.name for tool in self.tools or []]
        return self._sampling_params(
            max_tokens,
            logprobs,
            defaults,
            json_object=json_object,
            tool_names=tool_names,
            tool_call_optional=self.tool_choice in (None, "auto") and tool_names is not None,
            tool_parameters={
                t.function.name: t.function.parameters
                for t in self.tools or []
                if t.function.parameters is not None
            },
        )


class CompletionRequest(SamplingRequest):
    prompt: (
        Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
        | str
        | Annotated[list[str], Field(min_length=1)]
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's completions default
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported unless it equals n")
        return self

    def to_sampling_params(
        self, default_max_tokens: int, defaults: Mapping[str, float]
    ) -> SamplingParams:
        # echo returns the prompt too, so its logprobs as well.
        prompt_logprobs = self.logprobs if self.echo else None
        return self._sampling_params(
            self.max_tokens or default_max_tokens,
            self.logprobs,
            defaults,
            prompt_logprobs=prompt_logprobs,
        )


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a plain prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Default as vLLM: True for a prompt; False for messages, whose template adds its own.
    add_special_tokens: bool | None = None

    @model_validator(mode="after")
    def _check_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.add_special_tokens is None:
            self.add_special_tokens = self.prompt is not None
        return self


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[TokenId]
