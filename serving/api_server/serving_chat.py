"""POST /v1/chat/completions: chats rendered by the checkpoint's template, answers split into
reasoning, content and tool calls, whole or streamed.

Streamed and whole answers go through the same parsers (reasoning first, then tool calls in
what is left), so a stream's deltas add up to the whole answer. tool_choice "none" renders
no tools and parses none; "required" and a named function constrain decoding to one call
(tool_constraint.py), which the same parsers read back.
"""

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from serving.api_server.protocol import ChatCompletionRequest, ToolCall
from serving.api_server.responses import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
    DeltaToolCall,
    TopLogprob,
)
from serving.api_server.responses import TokenLogprob as LogprobEntry
from serving.api_server.serving_engine import (
    SSE_DONE,
    APIError,
    OpenAIServing,
    SSEResponse,
    clamp_logprob,
    error_json,
    sse,
    unless_disconnected,
    usage_info,
)
from serving.engine.llm_engine import EngineRequest
from serving.model.chat_format import ReasoningStream
from serving.model.tool_calls import ToolCallStream
from serving.sampling.params import TokenLogprob
from tasks.answers import THINK_START, parse_tool_calls, split_reasoning


def parse_chat_output(text: str, in_reasoning: bool, with_tools: bool) -> ChatResponseMessage:
    """A whole completion as an assistant message. `in_reasoning`: the prompt ended inside
    `<think>`; `with_tools`: tool-call blocks become `tool_calls` (content null if empty)."""
    reasoning, content = split_reasoning(THINK_START + text if in_reasoning else text)
    calls = []
    if with_tools:
        content, calls = parse_tool_calls(content)
    return ChatResponseMessage(
        content=(content or None) if calls else content,
        reasoning_content=reasoning,
        tool_calls=[ToolCall.model_validate(call.to_openai()) for call in calls] or None,
    )


class ChatDeltaParser:
    """`parse_chat_output` for one streamed choice: text deltas in, message deltas out."""

    def __init__(self, in_reasoning: bool, with_tools: bool) -> None:
        self._reasoning = ReasoningStream(in_reasoning=in_reasoning)
        self._tools = ToolCallStream() if with_tools else None

    @property
    def tools_called(self) -> bool:
        return bool(self._tools and self._tools.calls)

    def feed(self, text: str, final: bool = False) -> DeltaMessage | None:
        """The message delta for `text`, or None if it is all held back; `final` flushes."""
        reasoning, content = self._reasoning.feed(text)
        if final:
            more_reasoning, more_content = self._reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls = []
        if self._tools is not None:
            content, calls = self._tools.feed(content)
            if final:
                more_content, more_calls = self._tools.finish()
                content, calls = content + more_content, calls + more_calls
        if not (reasoning or content or calls):
            return None
        return DeltaMessage(
            reasoning_content=reasoning or None,
            content=content or None,
            tool_calls=[DeltaToolCall.model_validate(call) for call in calls] or None,
        )


def _finish_reason(reason: str | None, tools_called: bool) -> str | None:
    return "tool_calls" if reason == "stop" and tools_called else reason


def chat_logprobs(serving: OpenAIServing, logprobs: list[TokenLogprob]) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> dict:
        text = serving.token_text(token_id)
        return {"token": text, "logprob": clamp_logprob(logprob), "bytes": list(text.encode())}

    return ChatLogprobs(
        content=[
            LogprobEntry(
                **entry(lp.token_id, lp.logprob),
                top_logprobs=[TopLogprob(**entry(i, v)) for i, v in lp.top or []],
            )
            for lp in logprobs
        ]
    )


def _chunk_json(chunk: ChatCompletionChunk) -> str:
    """A chunk as OpenAI sends it: deltas carry only what they set; choices keep explicit
    nulls (finish_reason, logprobs); usage only in the final usage chunk."""
    data = chunk.model_dump()
    for choice in data["choices"]:
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    if data["usage"] is None:
        del data["usage"]
    return orjson.dumps(data).decode()


async def _stream(
    serving: OpenAIServing,
    request_id: str,
    engine_request: EngineRequest,
    parsers: list[ChatDeltaParser],
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatCompletionStreamChoice], **final: Any) -> str:
        """A chunk; the final one also sets `usage` and `metrics`."""
        data = ChatCompletionChunk(
            id=request_id, model=serving.model_name, created=created, choices=choices, **final
        )
        return sse(_chunk_json(data))

    yield chunk(
        [
            ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(engine_request.params.n)
        ]
    )
    completion_tokens = 0
    spec = None
    try:
        async with aclosing(serving.generate(request_id, engine_request)) as outputs:
            async for out in outputs:
                spec = out.spec
                choices = []
                for o in out.outputs:
                    completion_tokens += len(o.token_ids)
                    parser = parsers[o.index]
                    delta = parser.feed(o.text, final=o.finish_reason is not None)
                    logprobs = None
                    if engine_request.params.logprobs is not None and o.logprobs:
                        logprobs = chat_logprobs(serving, o.logprobs)
                    if delta is None and logprobs is None and o.finish_reason is None:
                        continue
                    choices.append(
                        ChatCompletionStreamChoice(
                            index=o.index,
                            delta=delta or DeltaMessage(),
                            logprobs=logprobs,
                            finish_reason=_finish_reason(o.finish_reason, parser.tools_called),
                            stop_reason=o.stop_reason,
                        )
                    )
                if choices:
                    yield chunk(choices)
    except APIError as e:
        yield sse(error_json(e))
        yield SSE_DONE
        return
    if include_usage:
        usage = usage_info(len(engine_request.prompt_token_ids), completion_tokens)
        yield chunk([], usage=usage, metrics=serving.response_metrics([spec]))
    yield SSE_DONE


def chat_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        serving.check_model(body.model)
        with_tools = bool(body.tools) and body.tool_choice != "none"
        prompt = serving.render_chat(
            body.messages,
            body.tools if with_tools else None,
            body.add_generation_prompt,
            body.chat_template_kwargs,
        )
        prompt_ids = serving.tokenizer.encode(prompt)
        params = body.to_sampling_params(
            serving.default_max_tokens(prompt_ids), serving.sampling_defaults
        )
        engine_request = serving.validate(prompt_ids, params)
        # Templates that open the reasoning for the model (R1-style) end the prompt in <think>.
        in_reasoning = prompt.rstrip().endswith(THINK_START)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        if body.stream:
            parsers = [ChatDeltaParser(in_reasoning, with_tools) for _ in range(params.n)]
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return SSEResponse(_stream(serving, request_id, engine_request, parsers, include_usage))

        final = await unless_disconnected(request, serving.collect(request_id, engine_request))
        if final is None:
            return Response(status_code=499)  # client closed the request; nobody reads this
        choices = []
        for o in final.outputs:
            message = parse_chat_output(o.text, in_reasoning, with_tools)
            choices.append(
                ChatCompletionChoice(
                    index=o.index,
                    message=message,
                    logprobs=chat_logprobs(serving, o.logprobs)
                    if params.logprobs is not None
                    else None,
                    finish_reason=_finish_reason(o.finish_reason, bool(message.tool_calls)),
                    stop_reason=o.stop_reason,
                )
            )
        completion_tokens = sum(len(o.token_ids) for o in final.outputs)
        response = ChatCompletionResponse(
            id=request_id,
            model=serving.model_name,
            choices=choices,
            usage=usage_info(len(prompt_ids), completion_tokens),
            metrics=serving.response_metrics([final.spec]),
        )
        return JSONResponse(response.model_dump())

    return router
