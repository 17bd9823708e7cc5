"""Held-out evaluation of a checkpoint on disk: the tier's own server app runs in this process
(no port, an ASGI transport) and the task harness plays it as it plays any server, so a
training run measures what a user of the exported model gets."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from serving.api_server.api_server import build_app
from serving.engine.async_engine import AsyncEngine
from serving.engine.llm_engine import LLMEngine
from serving.model.host_threads import build_off_thread
from tasks import harness


async def evaluate_checkpoint(
    model_dir: str | Path,
    domain_names: list[str],
    difficulties: list[int],
    n: int,
    run_seed: int,
    concurrency: int,
    **options: Any,
) -> list[harness.Record]:
    """`harness.run` against `model_dir` served in process; `options` are run's sampling ones."""
    async with served_client(model_dir) as client:
        return await harness.run(
            domain_names,
            difficulties,
            n,
            run_seed,
            concurrency,
            client=client,
            served_model=SERVED_MODEL,
            **options,
        )


SERVED_MODEL = "local"  # the name `served_client`'s server answers to


@asynccontextmanager
async def served_client(model_dir: str | Path) -> AsyncIterator[httpx.AsyncClient]:
    """A client of `model_dir` served by the tier's app in this process (its API root)."""
    # Built on a passing thread, as the server builds its own: see host_threads.
    engine = build_off_thread(lambda: LLMEngine.from_checkpoint(str(model_dir)))
    aengine = AsyncEngine(engine)
    try:
        app = build_app(aengine, engine.tokenizer, SERVED_MODEL)
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://local/v1/") as client:
            yield client
    finally:
        aengine.stop()
