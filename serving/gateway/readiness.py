"""Which ready tier takes a request: the gateway sends traffic only to tiers whose /health
answers 200 (they serve at full speed), and a request that no ready tier can take waits a
bounded time for one, then gets a 503 with Retry-After, as a load balancer in front of vLLM
servers would answer while none of them is healthy.

A tier that is down or still warming up is skipped for the other one when that is ready and
fallback is on, for a routed request and for one that names its tier alike (the headers say
which tier answered and why: `tier_down` or `tier_warming`), as a crashed tier always was;
with fallback off, a request waits for its own tier.
"""

import asyncio
from collections.abc import Mapping

from router.policy import Decision, Tier, other_tier
from serving.api_server.serving_engine import APIError
from serving.gateway.upstream import TierState, Upstream

# How often a waiting request looks at the tiers' states again (the supervisor probes a
# starting or warming tier every 0.1 s).
_POLL_S = 0.05


class NoTierReady(APIError):
    """A 503 for a request that no ready tier could take within the wait."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(
            503,
            message,
            type="server_error",
            code="no_tier_ready",
            headers={"Retry-After": str(retry_after_s)},
        )


def gateway_status(upstreams: Mapping[Tier, Upstream]) -> str:
    """The gateway's /health status: ok (every tier ready), degraded (some), warming (none
    yet, one starting or warming up) or unavailable."""
    ready = [u.available for u in upstreams.values()]
    if all(ready):
        return "ok"
    if any(ready):
        return "degraded"
    starting = (TierState.STARTING, TierState.WARMING)
    return "warming" if any(u.state in starting for u in upstreams.values()) else "unavailable"


def ready_now(
    decision: Decision, upstreams: Mapping[Tier, Upstream], fallback: bool
) -> Decision | None:
    """The decision if its tier is ready; else, with `fallback`, moved to the other tier if
    that one is ready; else None."""
    upstream = upstreams[decision.tier]
    if upstream.available:
        return decision
    other = upstreams[other_tier(decision.tier)]
    if fallback and other.available:
        reason = "tier_warming" if upstream.state == TierState.WARMING else "tier_down"
        return decision.moved(other.tier, reason)
    return None


def _states(upstreams: Mapping[Tier, Upstream]) -> str:
    parts = []
    for tier, upstream in upstreams.items():
        warmup = upstream.warmup if upstream.state == TierState.WARMING else None
        progress = (
            f", {warmup.get('graphs_compiled')} of {warmup.get('graphs_wanted')} graphs compiled"
            if warmup
            else ""
        )
        parts.append(f"{tier}: {upstream.state}{progress}")
    return "; ".join(parts)


async def wait_for_ready(
    decision: Decision,
    upstreams: Mapping[Tier, Upstream],
    fallback: bool,
    wait_s: float,
    retry_after_s: int,
) -> Decision:
    """The decision (or its move to the other tier) once a tier that may take it is ready,
    waiting up to `wait_s`; NoTierReady after that."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while (ready := ready_now(decision, upstreams, fallback)) is None:
        if loop.time() >= deadline:
            which = "No tier is" if fallback else f"The {decision.tier} tier is not"
            raise NoTierReady(
                f"{which} ready to serve after {wait_s:g} s ({_states(upstreams)}); retry later.",
                retry_after_s,
            )
        await asyncio.sleep(_POLL_S)
    return ready
