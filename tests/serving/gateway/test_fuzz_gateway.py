"""Schemathesis against the gateway's own OpenAPI schema: valid and invalid requests,
generated from the body models, to every operation; the gateway must never answer a 5xx.

The gateway runs in process over canned tiers (`loadtests/canned_tier.py` as ASGI apps), so
a thousand cases take seconds.
"""

import sys

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from serving.gateway.app import build_gateway_app
from serving.gateway.config import GatewayConfig
from serving.gateway.upstream import TierState
from tests import REPO

sys.path.insert(0, str(REPO / "loadtests"))
from canned_tier import canned_app

MODELS = {"full": "fuzz-full", "highspeed": "fuzz-fast"}
EXAMPLES_PER_OPERATION_AND_MODE = 125
MIN_CASES = 1000


def gateway_over_canned_tiers():
    remote = {
        tier: {"engine": "remote", "base_url": f"http://{tier}.test/v1", "model": model}
        for tier, model in MODELS.items()
    }
    app = build_gateway_app(
        GatewayConfig.model_validate({"tiers": remote, "router": {"policy": "heuristic"}})
    )
    for tier, upstream in app.state.gateway.upstreams.items():
        upstream.transport = httpx.ASGITransport(canned_app(MODELS[tier]))
        upstream.client = httpx.AsyncClient(transport=upstream.transport)
        upstream.state = TierState.HEALTHY
    return app


def fuzz(
    operation: schemathesis.APIOperation, mode: GenerationMode, server_errors: list[str]
) -> int:
    """Run one operation's generated cases in one mode; the number of cases run."""
    count = 0

    @given(operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES_PER_OPERATION_AND_MODE,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case) -> None:
        nonlocal count
        count += 1
        response = case.call()
        if response.status_code >= 500:
            server_errors.append(f"{case.as_curl_command()} -> {response.status_code}")

    try:
        run()
    except Unsatisfiable:  # nothing to make invalid (GET /health has no parameters)
        assert mode == GenerationMode.NEGATIVE
    return count


@pytest.mark.slow
def test_no_generated_request_gets_a_5xx():
    app = gateway_over_canned_tiers()
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    body = schema.raw_schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("/ChatBody")
    server_errors: list[str] = []
    cases = {
        (result.ok().label, mode.value): fuzz(result.ok(), mode, server_errors)
        for result in schema.get_all_operations()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    }
    print(f"schemathesis: {sum(cases.values())} cases, {len(server_errors)} 5xx: {cases}")
    assert not server_errors, server_errors[:5]
    assert sum(cases.values()) >= MIN_CASES
    assert cases[("POST /v1/chat/completions", "positive")] >= EXAMPLES_PER_OPERATION_AND_MODE
