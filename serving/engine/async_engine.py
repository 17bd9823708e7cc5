"""The engine behind an asyncio server: a background thread steps it, requests await queues.

Only the engine thread touches the engine's state; the event loop sends it commands (add,
abort) through a queue and receives outputs through one asyncio queue per request. Torch
releases the GIL inside its kernels, so the event loop keeps serving while a step runs.

A step's outputs reach the loop in one wake-up, not one per request; a request whose
consumer fell behind gets its waiting deltas merged, so it writes one SSE event per wake-up
carrying all its new tokens.
"""

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from serving.engine.llm_engine import EngineRequest, LLMEngine
from serving.engine.outputs import RequestOutput

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop crashed; the server reports unhealthy and must be restarted."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    async def generate(
        self, request_id: str, request: EngineRequest
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of one validated request until it finishes; closing the iterator early
        aborts it."""
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._send(("add", request_id, request))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                while not isinstance(item, BaseException) and not stream.queue.empty():
                    later = stream.queue.get_nowait()
                    item = later if isinstance(later, BaseException) else item.merge(later)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """One wake-up per event loop for all of them (each wake-up is a syscall and a turn
        of the loop)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped:
            while not self._commands.empty():
                kind, request_id, *args = self._commands.get()
                if kind == "abort":
                    engine.abort(request_id)
                    continue
                try:
                    engine.enqueue(request_id, *args)
                except Exception as e:  # validated before, so only races like a duplicate id
                    self._deliver(request_id, e)
            if not engine.has_unfinished():
                engine.idle()
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as e:
                log.exception("engine step failed; failing every request")
                self.error = e
                for request_id in list(engine.requests):
                    engine.abort(request_id)
                    self._deliver(request_id, EngineDeadError(f"engine failure: {e}"))
                return
            self._deliver_all([(out.request_id, out) for out in outputs])


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in puts:
        q.put_nowait(item)
