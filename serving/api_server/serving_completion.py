"""POST /v1/completions: raw prompts (text or token ids, one or a batch) with echo and the
legacy logprobs shape, whole or streamed. Prompt i's n choices have indices i*n .. i*n+n-1."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from serving.api_server.protocol import CompletionRequest
from serving.api_server.responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
)
from serving.api_server.serving_engine import (
    SSE_DONE,
    APIError,
    OpenAIServing,
    SSEResponse,
    clamp_logprob,
    error_json,
    merge,
    sse,
    unless_disconnected,
    usage_info,
)
from serving.engine.llm_engine import EngineRequest
from serving.sampling.params import TokenLogprob
from speculative.counts import SpecCounts


class LogprobsBuilder:
    """One choice's legacy logprobs, built delta by delta. Text offsets count characters from
    the start of the choice's text (the prompt's, with echo); the top-logprobs dicts hold the
    top k and the chosen token, as vLLM's do."""

    def __init__(self, serving: OpenAIServing) -> None:
        self._serving = serving
        self._offset = 0

    def add(
        self, token_ids: list[int], logprobs: Sequence[TokenLogprob | None]
    ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            text = self._serving.token_text(token_id)
            out.tokens.append(text)
            out.text_offset.append(self._offset)
            self._offset += len(text)
            if lp is None:  # the first prompt token: nothing came before it
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(clamp_logprob(lp.logprob))
            top = {self._serving.token_text(i): clamp_logprob(v) for i, v in lp.top or []}
            top.setdefault(text, clamp_logprob(lp.logprob))
            out.top_logprobs.append(top)
        return out


@dataclass
class _Prompt:
    """One prompt of the batch: the text that echo returns, and the validated request."""

    text: str
    request: EngineRequest

    @property
    def ids(self) -> list[int]:
        return self.request.prompt_token_ids


def _prompts(serving: OpenAIServing, body: CompletionRequest) -> list[_Prompt]:
    """The batch's prompts, each validated before any of them runs."""
    raw = body.prompt
    if isinstance(raw, str) or isinstance(raw[0], int):
        raw = [raw]
    prompts = []
    for p in raw:
        if isinstance(p, str):
            text, ids = p, serving.tokenizer.encode(p, add_special_tokens=True)
        else:
            text = serving.tokenizer.decode(p, skip_special_tokens=False) if body.echo else ""
            ids = p
        params = body.to_sampling_params(serving.default_max_tokens(ids), serving.sampling_defaults)
        prompts.append(_Prompt(text, serving.validate(ids, params)))
    return prompts


async def _stream(
    serving: OpenAIServing,
    body: CompletionRequest,
    request_id: str,
    prompts: list[_Prompt],
    include_usage: bool,
) -> AsyncIterator[str]:
    created, n = int(time.time()), body.n
    builders = {i: LogprobsBuilder(serving) for i in range(len(prompts) * n)}
    prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}
    echoed: set[int] = set()
    completion_tokens = 0
    spec: dict[int, SpecCounts | None] = {}

    def chunk(choices: list[CompletionChoice], **final: Any) -> str:
        """A chunk; the final one also sets `usage` and `metrics`."""
        data = CompletionChunk(
            id=request_id, model=serving.model_name, created=created, choices=choices, **final
        ).model_dump()
        if data["usage"] is None:
            del data["usage"]
        return sse(orjson.dumps(data).decode())

    streams = [serving.generate(f"{request_id}-{i}", p.request) for i, p in enumerate(prompts)]
    try:
        async with aclosing(merge(streams)) as outputs:
            async for i, out in outputs:
                spec[i] = out.spec
                prompt = prompts[i]
                if out.prompt_logprobs is not None:
                    prompt_logprobs[i] = out.prompt_logprobs
                choices = []
                for o in out.outputs:
                    completion_tokens += len(o.token_ids)
                    index = i * n + o.index
                    text, ids, lps = o.text, o.token_ids, list(o.logprobs)
                    if body.echo and index not in echoed:
                        echoed.add(index)
                        text, ids = prompt.text + text, prompt.ids + ids
                        lps = prompt_logprobs.get(i, []) + lps
                    logprobs = None
                    if prompt.request.params.logprobs is not None:
                        logprobs = builders[index].add(ids, lps)
                    choices.append(
                        CompletionChoice(
                            index=index,
                            text=text,
                            logprobs=logprobs,
                            finish_reason=o.finish_reason,
                            stop_reason=o.stop_reason,
                        )
                    )
                yield chunk(choices)
    except APIError as e:
        yield sse(error_json(e))
        yield SSE_DONE
        return
    if include_usage:
        usage = usage_info(sum(len(p.ids) for p in prompts), completion_tokens)
        yield chunk([], usage=usage, metrics=serving.response_metrics(list(spec.values())))
    yield SSE_DONE


def completions_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        serving.check_model(body.model)
        prompts = _prompts(serving, body)
        request_id = f"cmpl-{uuid.uuid4().hex}"

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return SSEResponse(_stream(serving, body, request_id, prompts, include_usage))

        finals = await unless_disconnected(
            request,
            asyncio.gather(
                *(serving.collect(f"{request_id}-{i}", p.request) for i, p in enumerate(prompts))
            ),
        )
        if finals is None:
            return Response(status_code=499)  # client closed the request; nobody reads this
        choices = []
        for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            for o in final.outputs:
                text, ids, lps = o.text, o.token_ids, list(o.logprobs)
                if body.echo:
                    text, ids = prompt.text + text, prompt.ids + ids
                    lps = list(final.prompt_logprobs or []) + lps
                logprobs = None
                if prompt.request.params.logprobs is not None:
                    logprobs = LogprobsBuilder(serving).add(ids, lps)
                choices.append(
                    CompletionChoice(
                        index=i * body.n + o.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                    )
                )
        completion_tokens = sum(len(o.token_ids) for f in finals for o in f.outputs)
        response = CompletionResponse(
            id=request_id,
            model=serving.model_name,
            choices=choices,
            usage=usage_info(sum(len(p.ids) for p in prompts), completion_tokens),
            metrics=serving.response_metrics([f.spec for f in finals]),
        )
        return JSONResponse(response.model_dump())

    return router
