"""The endpoints one tier answers as it is, through the gateway: the tokenizer's (both tiers
share one tokenizer) and each tier's own Prometheus metrics."""

import httpx
from fastapi import Response
from prometheus_client import CONTENT_TYPE_LATEST

from router.override import AUTO_MODEL
from router.policy import TIERS, Tier
from router.router import Router
from serving.api_server.serving_engine import APIError
from serving.gateway.proxy import UpstreamFailure, post, upstream_payload
from serving.gateway.schema import TokenizerBody
from serving.gateway.upstream import Upstream


async def forward_tokenizer(
    upstreams: dict[Tier, Upstream], router: Router, path: str, request: TokenizerBody
) -> Response:
    """/tokenize and /detokenize, answered by the named tier (the full tier for `auto`)."""
    body = request.model_dump(exclude_unset=True)
    model = body.get("model")
    tier = "full" if model in (None, AUTO_MODEL) else router.model_tiers.get(model)
    if tier is None:
        raise APIError(404, f"The model `{model}` does not exist.", param="model",
                       code="model_not_found")  # fmt: skip
    upstream = upstreams[tier]
    address, payload = upstream.server_root + path, upstream_payload(body, upstream.model)
    try:
        result = await post(upstream, address, payload, {}, stream=False)
    except UpstreamFailure as e:
        raise APIError(502, str(e), type="server_error") from e
    await result.close()
    return Response(
        result.response.content,
        result.response.status_code,
        media_type=result.response.headers.get("content-type"),
    )


async def tier_metrics(upstreams: dict[Tier, Upstream], tier: str) -> Response:
    upstream = upstreams.get(tier)  # type: ignore[call-overload]
    if upstream is None:
        raise APIError(404, f"No tier {tier!r}; tiers: {', '.join(TIERS)}")
    try:
        response = await upstream.client.get(upstream.metrics_url, timeout=5.0)
    except httpx.HTTPError as e:
        raise APIError(502, f"{tier} tier metrics unavailable: {e!r}", type="server_error") from e
    return Response(response.content, response.status_code, media_type=CONTENT_TYPE_LATEST)
