"""What the tests of the tier server's app share: its client over ASGI, request bodies,
checks of OpenAI's error shape and of SSE streams, parsed /metrics."""

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny-moe"
MAX_MODEL_LEN = 256
USER = [{"role": "user", "content": "Write a haiku about the sea."}]
ERROR_KEYS = {"message", "type", "param", "code"}


def asgi_client(app, raise_app_exceptions: bool = True, **headers: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app, raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url="http://tier", headers=headers)


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, "temperature": 0, **fields}


def events(response: httpx.Response) -> list[dict]:
    """The SSE stream's JSON events; asserts it is well formed and ends in [DONE]."""
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""]
    assert all(block.startswith("data: ") for block in blocks[:-1])
    return [json.loads(block.removeprefix("data: ")) for block in blocks[:-2]]


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"]
    assert "Traceback" not in response.text
    if code is not None:
        assert error["code"] == code
    return error


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page, parsed by prometheus-client, by name and labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
