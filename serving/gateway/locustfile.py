"""Locust users for tierserve: a realistic mix through the OpenAI API.

Each request is an easy (difficulty 1) or hard (difficulty 3) task of the project's domains
(math, code, terminal, tools), its first request as the task registry starts it, sent as
chat (with the task's tools) or as a completion, streamed or not, with a varied max_tokens,
and routed by `auto` or pinned to a tier by model name or header. Requests are
named by what was asked and the tier that answered (`chat stream [full]`); streams also
report time to first token (`TTFT`) and inter-token latency (`ITL`) per tier as their own
entries. Overload answers (429) and stream error events count as failures, by their code.

    locust -f serving/gateway/locustfile.py --host http://127.0.0.1:8000
    tierserve loadtest --users 8 --spawn-rate 2 --duration 60   # headless, with a report

Environment: TIERSERVE_API_KEY (sent as a bearer key).
"""

import json
import os
import random
import time
from typing import Any

from locust import HttpUser, between, task
from locust.clients import ResponseContextManager

from tasks import opening_requests

MAX_TOKENS = (16, 32, 64, 128)
# (model, header) choices: mostly left to the router, some pinned.
ROUTES = [("auto", None)] * 4 + [("full", None), ("highspeed", None), ("auto", "full")]
PROMPTS = opening_requests(per_kind=16)


def _error_code(response: ResponseContextManager) -> str:
    try:
        error = response.json()["error"]
        return str(error.get("code") or error.get("type"))
    except (ValueError, KeyError, TypeError):
        return "no_error_body"


class TierserveUser(HttpUser):
    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        self.rng = random.Random()
        key = os.environ.get("TIERSERVE_API_KEY")
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"

    def _request(self) -> tuple[str, str, dict[str, Any], dict[str, str]]:
        """A random request: its label, path, body and headers."""
        prompt = self.rng.choice(PROMPTS)
        model, header = self.rng.choice(ROUTES)
        stream = self.rng.random() < 0.6
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.rng.choice(MAX_TOKENS),
            "temperature": self.rng.choice((0.0, 0.7)),
            "stream": stream,
        }
        if self.rng.random() < 0.8:
            path, endpoint = "/v1/chat/completions", "chat"
            body["messages"] = prompt["messages"]
            if prompt["tools"]:
                body["tools"] = prompt["tools"]
        else:
            path, endpoint = "/v1/completions", "completion"
            body["prompt"] = prompt["messages"][-1]["content"]
        headers = {"X-Tierserve-Tier": header} if header else {}
        label = f"{endpoint} {'stream' if stream else 'whole'}"
        return label, path, body, headers

    def _latency(self, kind: str, tier: str, seconds: float) -> None:
        self.environment.events.request.fire(
            request_type=kind,
            name=tier,
            response_time=1000 * seconds,
            response_length=0,
            exception=None,
            context={},
        )

    @task
    def generate(self) -> None:
        label, path, body, headers = self._request()
        start = time.perf_counter()
        with self.client.post(
            path, json=body, headers=headers, stream=body["stream"], catch_response=True,
            name=label,
        ) as response:  # fmt: skip
            tier = response.headers.get("x-tierserve-tier", "none")
            response.request_meta["name"] = f"{label} [{tier}]"
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code} {_error_code(response)}")
            elif body["stream"]:
                self._read_stream(response, tier, start)
                # Locust times a stream to its headers; this request took until its end.
                response.request_meta["response_time"] = 1000 * (time.perf_counter() - start)
            else:
                response.success()

    def _read_stream(self, response: ResponseContextManager, tier: str, start: float) -> None:
        """Read the SSE stream, reporting TTFT and each inter-token gap; an error event (a
        tier that died mid-stream) or a stream without [DONE] is a failure."""
        last: float | None = None
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                response.success()
                return
            event = json.loads(line[6:])
            if "error" in event:
                response.failure(f"stream error {event['error'].get('code') or 'unknown'}")
                return
            choices = event.get("choices") or [{}]
            delta = choices[0].get("delta") or {}
            text = choices[0].get("text") or delta.get("content") or delta.get("reasoning_content")
            if not text and not delta.get("tool_calls"):
                continue
            now = time.perf_counter()
            if last is None:
                self._latency("TTFT", tier, now - start)
            else:
                self._latency("ITL", tier, now - last)
            last = now
        response.failure("stream ended without [DONE]")
