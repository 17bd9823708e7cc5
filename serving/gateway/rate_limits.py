"""How much a client may ask: per-client rate limits (requests and tokens per minute) as
token buckets, and the gateway's set of API keys."""

import math
import os
import time
from dataclasses import dataclass, field

from serving.api_server.serving_engine import APIError
from serving.gateway.config import GatewayConfig, RateLimitConfig


def load_api_keys(config: GatewayConfig) -> list[str]:
    """Every key the gateway accepts: `api_key`, `auth.api_keys`, the keys file and the
    environment variable, without duplicates."""
    keys = [config.api_key] if config.api_key else []
    keys += config.auth.api_keys
    if config.auth.api_keys_file is not None:
        lines = config.auth.api_keys_file.read_text().splitlines()
        keys += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    keys += [k.strip() for k in os.environ.get(config.auth.api_keys_env, "").split(",")]
    return list(dict.fromkeys(k for k in keys if k))


@dataclass
class TokenBucket:
    """`capacity` units that refill at `capacity` per minute. A request larger than the
    whole bucket passes when the bucket is full (it would never pass otherwise) and leaves
    it in debt, so its cost still counts."""

    capacity: float
    level: float
    updated: float = field(default_factory=time.monotonic)

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60)
        self.updated = now

    def wait_s(self, amount: float, now: float) -> float:
        """0 if `amount` can be taken now, else the seconds until it can."""
        self._refill(now)
        if self.level >= min(amount, self.capacity):
            return 0.0
        return (min(amount, self.capacity) - self.level) * 60 / self.capacity

    def take(self, amount: float) -> None:
        self.level -= amount


@dataclass
class Charge:
    """Tokens taken up front for one request (its prompt estimate plus max_tokens); settled
    against the usage the tier reports when it ends, so a client pays what it used."""

    bucket: TokenBucket | None
    estimate: int

    def settle(self, used_tokens: int | None) -> None:
        if self.bucket is not None:
            self.bucket.level += self.estimate - (used_tokens or 0)
            self.bucket.level = min(self.bucket.level, self.bucket.capacity)


class RateLimiter:
    def __init__(self, config: RateLimitConfig) -> None:
        self.config = config
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    @staticmethod
    def _bucket(buckets: dict[str, TokenBucket], client: str, per_minute: int) -> TokenBucket:
        bucket = buckets.get(client)
        if bucket is None:
            bucket = buckets[client] = TokenBucket(per_minute, per_minute)
        return bucket

    def charge(self, client: str, estimated_tokens: int) -> Charge:
        """Take one request and the estimated tokens from the client's buckets, or raise a
        429 saying which limit and when to retry (and take nothing)."""
        now = time.monotonic()
        limits = (
            ("requests", self._requests, self.config.requests_per_minute, 1),
            ("tokens", self._tokens, self.config.tokens_per_minute, estimated_tokens),
        )
        buckets = []
        for kind, table, per_minute, amount in limits:
            if per_minute is None:
                buckets.append(None)
                continue
            bucket = self._bucket(table, client, per_minute)
            wait = bucket.wait_s(amount, now)
            if wait > 0:
                raise APIError(
                    429,
                    f"Rate limit reached on {kind} per minute (limit {per_minute}); "
                    f"retry in {wait:.1f} s.",
                    type=kind,
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(math.ceil(wait))},
                )
            buckets.append(bucket)
        requests, tokens = buckets
        if requests is not None:
            requests.take(1)
        if tokens is not None:
            tokens.take(estimated_tokens)
        return Charge(tokens, estimated_tokens)
