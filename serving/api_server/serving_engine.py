"""What the OpenAI generation endpoints share: the served model, OpenAI-shaped errors, and
running engine requests with metrics, streaming as server-sent events, and an abort when
the client goes away."""

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from serving.api_server.metrics import ServerMetrics
from serving.api_server.responses import (
    ErrorInfo,
    ErrorResponse,
    ResponseMetrics,
    SpecDecodeMetrics,
    UsageInfo,
)
from serving.engine.async_engine import AsyncEngine, EngineDeadError
from serving.engine.llm_engine import (
    EngineInputError,
    EngineRequest,
    RequestOutput,
    SequenceOutput,
)
from serving.model.tokenizer import ChatTemplateError, Tokenizer
from serving.sampling.params import SamplingParams
from speculative.counts import SpecCounts

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"
# Names apply_chat_template sets itself; chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})
# vLLM's floor for -inf logprobs, which JSON cannot carry.
MIN_LOGPROB = -9999.0


class APIError(Exception):
    """An error the client gets as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: int | str | None = None,
        headers: dict[str, str] | None = None,  # e.g. Retry-After on a 429
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.headers = headers
        self.body = ErrorResponse(
            error=ErrorInfo(message=message, type=type, param=param, code=code)
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), self.status_code, headers=self.headers)


def error_json(error: APIError) -> str:
    """The error as a stream event's payload, for failures after a stream has started."""
    return json.dumps(error.body.model_dump())


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends, so an
    early end (client gone, send failed) aborts the engine requests at once, not at GC."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _client_gone(request: Request) -> None:
    # After the body is read, the next ASGI message is the disconnect (or the response end).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, or cancel it (aborting its engine requests) and return None if the
    client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with their stream's index. Closing the
    merged stream cancels (and so closes) every stream still running."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, done))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def spec_metrics(counts: list[SpecCounts | None], num_spec_tokens: int) -> ResponseMetrics | None:
    """A response's speculative decoding (over its engine requests); None without any."""
    total = SpecCounts()
    for c in counts:
        if c is not None:
            total.merge(c)
    if not total.num_drafts:
        return None
    return ResponseMetrics(
        speculative_decoding=SpecDecodeMetrics(
            num_spec_tokens=num_spec_tokens,
            num_spec_steps=total.num_drafts,
            num_draft_tokens=total.num_draft_tokens,
            num_accepted_draft_tokens=total.num_accepted_tokens,
            draft_acceptance_rate=total.num_accepted_tokens / total.num_draft_tokens,
            mean_acceptance_length=1 + total.num_accepted_tokens / total.num_drafts,
            acceptance_histogram=total.acceptance_histogram,
        )
    )


def usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


@dataclass
class OpenAIServing:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    metrics: ServerMetrics
    # What requests that leave sampling fields unset inherit (`sampling_defaults`).
    sampling_defaults: dict[str, float] = field(default_factory=dict)

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def response_metrics(self, counts: list[SpecCounts | None]) -> ResponseMetrics | None:
        spec = self.engine.engine.config.speculative
        return spec_metrics(counts, spec.num_speculative_tokens) if spec else None

    def check_model(self, model: str | None) -> None:
        """A request may omit the model (as vLLM allows) but not name another one."""
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist.",
                param="model",
                code="model_not_found",
            )

    def default_max_tokens(self, prompt_token_ids: list[int]) -> int:
        """The rest of the context, as vLLM; at least 1 so a too-long prompt gets the
        context-length error rather than a confusing one about max_tokens."""
        return max(1, self.max_model_len - len(prompt_token_ids))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> EngineRequest:
        """The one check of a request against the engine (context length, token ids, what
        constraints need); a 400 on failure. What it returns goes inward unchecked."""
        try:
            return self.engine.engine.validate(prompt_token_ids, params)
        except EngineInputError as e:
            raise APIError(400, str(e)) from e

    def render_chat(
        self,
        messages: Sequence[BaseModel],
        tools: Sequence[BaseModel] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> str:
        """The chat as the checkpoint's template renders it (as transformers would)."""
        kwargs = template_kwargs or {}
        if reserved := _RESERVED_TEMPLATE_KWARGS & kwargs.keys():
            raise APIError(
                400,
                f"chat_template_kwargs may not set {sorted(reserved)}",
                param="chat_template_kwargs",
            )
        try:
            return self.tokenizer.apply_chat_template(
                [m.model_dump(exclude_none=True) for m in messages],
                tools=None if tools is None else [t.model_dump(exclude_none=True) for t in tools],
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except ChatTemplateError as e:
            raise APIError(400, f"The chat could not be rendered: {e}", param="messages") from e

    def token_text(self, token_id: int) -> str:
        """One token as logprobs show it: its own decoded text, as vLLM does."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def generate(
        self, request_id: str, request: EngineRequest
    ) -> AsyncIterator[RequestOutput]:
        """The engine's deltas, recorded in the metrics; closing early aborts the request."""
        tracker = self.metrics.track()
        try:
            async with aclosing(self.engine.generate(request_id, request)) as it:
                async for out in it:
                    tracker.observe(out)
                    yield out
        except EngineInputError as e:
            raise APIError(400, str(e)) from e
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error") from e
        finally:
            tracker.abort()  # a no-op once the request finished

    async def collect(self, request_id: str, request: EngineRequest) -> RequestOutput:
        """Run a request to the end: its outputs accumulated, its prompt logprobs."""
        n = request.params.n
        final = RequestOutput(
            request_id, request.prompt_token_ids, [SequenceOutput(i) for i in range(n)], False
        )
        async with aclosing(self.generate(request_id, request)) as it:
            async for out in it:
                final.prompt_logprobs = final.prompt_logprobs or out.prompt_logprobs
                final.num_cached_tokens = out.num_cached_tokens
                final.finished = out.finished
                final.spec = out.spec
                for delta in out.outputs:
                    final.outputs[delta.index].extend(delta)
        return final
