"""The in-process gateway over scripted tiers, for the gateway's tests."""

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.serving.gateway.scripted_tiers import MODELS, ScriptedTier, make_app


@pytest.fixture
def tiers() -> dict:
    """Scripted tiers for the in-process gateway."""
    return {tier: ScriptedTier(tier) for tier in MODELS}


@pytest.fixture
async def client(tiers: dict) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the gateway app over the scripted tiers."""
    app = make_app(tiers)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
        yield c
