"""The gateway's configuration (`tierserve serve --config FILE`, YAML or JSON), validated by
pydantic so a wrong field is reported by name before anything starts.

With no file, the shipped default: both tiers embedded, served from `models/demo-full` and
`models/demo-highspeed`, routed by `models/router.npz` when it exists (else the heuristic).
"""

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    HttpUrl,
    Tag,
    ValidationError,
    model_validator,
)

from serving.model.checkpoint import check_checkpoint
from serving.model.config import CheckpointError
from serving.model.device import DEVICE_CHOICES, UnsupportedDeviceError, resolve_device
from serving.model.dtype import (
    DTYPE_CHOICES,
    UnsupportedDtypeError,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from speculative.config import SpeculativeConfig

Port = Annotated[int, Field(ge=1, le=65535)]
Seconds = Annotated[float, Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not a no-op


class EmbeddedTier(_Strict):
    """A `tierserve engine` child process that the gateway starts and supervises."""

    engine: Literal["embedded"] = "embedded"
    model: Path  # checkpoint directory
    port: Port | None = None  # None: a free local port
    served_model_name: str | None = None  # default: the directory's name
    max_num_seqs: Annotated[int, Field(ge=1)] | None = None
    max_num_batched_tokens: Annotated[int, Field(ge=1)] | None = None
    kv_cache_memory_mib: Annotated[int, Field(ge=1)] | None = None
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    threads: Annotated[int, Field(ge=1)] = 1  # torch threads of the child (OMP_NUM_THREADS)
    api_key: str | None = None  # if set, the child requires it and the gateway sends it
    speculative: SpeculativeConfig | None = None  # `tierserve engine --speculative-config`
    dtype: Literal[DTYPE_CHOICES] = "auto"  # `tierserve engine --dtype`
    kv_cache_dtype: Literal[DTYPE_CHOICES] = "auto"  # `tierserve engine --kv-cache-dtype`
    device: Literal[DEVICE_CHOICES] = "auto"  # `tierserve engine --device`
    # `--gpu-memory-utilization`: the engine's default (0.9) suits one tier per GPU.
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    enforce_eager: bool = False  # `tierserve engine --enforce-eager`

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.resolve().name


class RemoteTier(_Strict):
    """Any OpenAI-compatible server, e.g. a vLLM deployment; the gateway only probes it."""

    engine: Literal["remote"]
    base_url: HttpUrl  # the API root, e.g. http://vllm-full:8000/v1
    model: str  # the model name that server serves
    api_key: str | None = None
    health_path: str = "/health"  # relative to the server root (vLLM and ours: /health)
    metrics_path: str = "/metrics"

    @property
    def model_name(self) -> str:
        return self.model


# vLLM's `--dtype` choices.
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


class VllmTier(_Strict):
    """vLLM's OpenAI server as a child the gateway starts and supervises, as it does an
    embedded tier. vLLM lives in its own environment (its torch is not ours), so `python` names
    that environment's interpreter; the fields are vLLM's flags, and `extra_args` takes any
    other."""

    engine: Literal["vllm"]
    model: Path  # checkpoint directory (`--model`)
    python: Path = Path(".venv-vllm/bin/python")  # the interpreter vLLM is installed in
    port: Port | None = None  # None: a free local port
    served_model_name: str | None = None  # default: the directory's name
    dtype: Literal[VLLM_DTYPES] = "auto"
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    max_num_seqs: Annotated[int, Field(ge=1)] | None = None
    tensor_parallel_size: Annotated[int, Field(ge=1)] | None = None
    enable_expert_parallel: bool = False  # experts spread over the tensor-parallel GPUs
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    # vLLM's `--speculative-config`, in vLLM's own terms (e.g. a draft model, or MTP).
    speculative_config: dict[str, Any] | None = None
    tool_call_parser: str | None = "hermes"  # with --enable-auto-tool-choice; None: neither
    reasoning_parser: str | None = "qwen3"  # answers' <think> in `reasoning_content`
    api_key: str | None = None  # if set, vLLM requires it and the gateway sends it
    # VLLM_CPU_KVCACHE_SPACE: the KV cache of vLLM's CPU build, in GiB (its GPU build sizes
    # its cache from gpu_memory_utilization instead).
    cpu_kv_cache_space_gib: Annotated[int, Field(ge=1)] | None = None
    env: dict[str, str] = {}  # more environment for the child, e.g. CUDA_VISIBLE_DEVICES
    extra_args: list[str] = []  # appended to the command line as they are

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.resolve().name


SupervisedTier = EmbeddedTier | VllmTier  # a child process the gateway starts


def _engine(value: object) -> str:
    """The tier's kind; `engine` may be left out for an embedded tier."""
    if isinstance(value, dict):
        return value.get("engine", "embedded")
    return getattr(value, "engine", "embedded")


TierConfig = Annotated[
    Annotated[EmbeddedTier, Tag("embedded")]
    | Annotated[VllmTier, Tag("vllm")]
    | Annotated[RemoteTier, Tag("remote")],
    Discriminator(_engine),
]


class Tiers(_Strict):
    full: TierConfig
    highspeed: TierConfig


class SpillConfig(_Strict):
    enabled: bool = True
    max_queue: Annotated[int, Field(ge=1)] = 64  # in-flight requests per tier before spilling
    margin: Annotated[float, Field(ge=0.0)] = 0.15


class CascadeConfig(_Strict):
    enabled: bool = False


class RouterConfig(_Strict):
    policy: Literal["auto", "learned", "heuristic"] = "auto"
    learned_path: Path = Path("models/router.npz")
    threshold: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # overrides calibration
    heuristic_threshold: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    spill: SpillConfig = SpillConfig()
    cascade: CascadeConfig = CascadeConfig()


class FallbackConfig(_Strict):
    enabled: bool = True  # retry once on the other tier before the first byte
    connect_timeout_s: Seconds = 5.0
    read_timeout_s: Seconds = 600.0  # longest wait for response headers or the next chunk


class SupervisorConfig(_Strict):
    startup_timeout_s: Seconds = 300.0  # for a tier to be ready (/health 200); then logged
    health_interval_s: Seconds = 2.0
    restart_backoff_s: Seconds = 1.0  # doubled after each crash in a row
    max_restart_backoff_s: Seconds = 60.0
    stop_timeout_s: Seconds = 10.0  # SIGTERM to SIGKILL for a child
    # Per embedded tier, a `tierserve engine --standby` with its imports done, to replace the
    # tier when it dies (started once the tier is ready).
    standby: bool = True


class TierLimits(_Strict):
    """Admission to one tier: a bounded number of requests at the tier, a bounded queue."""

    max_in_flight: Annotated[int, Field(ge=1)] = 32  # the engine's default max_num_seqs
    max_queue: Annotated[int, Field(ge=0)] = 64  # waiting for a slot; beyond it: 429


class LimitsConfig(_Strict):
    """Backpressure: what the gateway accepts before it answers 429 (never a hang, never a
    5xx for overload)."""

    full: TierLimits = TierLimits()
    highspeed: TierLimits = TierLimits()
    queue_timeout_s: Seconds = 30.0  # a queued request waiting longer gets a 429
    # A whole answer, or a stream from arrival to its last byte; past it: 504, or a stream
    # ends with an error event.
    request_timeout_s: Seconds = 600.0
    max_concurrent_streams: Annotated[int, Field(ge=1)] = 256
    max_prompt_chars: Annotated[int, Field(ge=1)] = 200_000  # messages' or prompt's text
    max_body_bytes: Annotated[int, Field(ge=1)] = 4 << 20  # 413 beyond it
    retry_after_s: Annotated[int, Field(ge=1)] = 1  # the Retry-After of an overload 429 or 503
    # A request that no ready tier can take (starting, warming up, restarting) waits this long
    # for one, then gets a 503 with Retry-After (`serving/gateway/readiness.py`).
    tier_ready_wait_s: Seconds = 10.0


class RateLimitConfig(_Strict):
    """Per client (API key, or address when no keys are set), as token buckets that refill
    continuously; None: no limit."""

    requests_per_minute: Annotated[int, Field(ge=1)] | None = None
    tokens_per_minute: Annotated[int, Field(ge=1)] | None = None  # prompt + completion


class AuthConfig(_Strict):
    """API keys, from any of: this list, a file (one key a line, `#` comments), an
    environment variable (comma-separated). With none, the API is open."""

    api_keys: list[Annotated[str, Field(min_length=1)]] = []
    api_keys_file: Path | None = None
    api_keys_env: str = "TIERSERVE_API_KEYS"


class CORSConfig(_Strict):
    """Cross-origin access for browser clients; no origins: no CORS headers at all."""

    allow_origins: list[str] = []
    allow_methods: list[str] = ["GET", "POST", "OPTIONS"]
    allow_headers: list[str] = ["Authorization", "Content-Type", "X-Request-Id",
                                "X-Tierserve-Tier"]  # fmt: skip
    allow_credentials: bool = False
    max_age_s: Annotated[int, Field(ge=0)] = 600


class GatewayConfig(_Strict):
    host: str = "127.0.0.1"
    port: Port = 8000
    api_key: str | None = None  # one key (kept for old configs); `auth` takes several
    auth: AuthConfig = AuthConfig()
    rate_limits: RateLimitConfig = RateLimitConfig()
    limits: LimitsConfig = LimitsConfig()
    cors: CORSConfig = CORSConfig()
    json_logs: bool = True  # one JSON object per log line on stderr
    # The highspeed tier drafts with its own MTP layer, as the design has it: greedy output
    # is plain decoding's, sampled output distributed as plain decoding's. On a CPU it pays
    # for one or two streams and not for four (`loadtests/bench_speculative.py`), so steps
    # with more than two requests running do not speculate. `tiers.highspeed.speculative:
    # null` turns it off.
    tiers: Tiers = Tiers(
        full=EmbeddedTier(model=Path("models/demo-full")),
        highspeed=EmbeddedTier(
            model=Path("models/demo-highspeed"),
            speculative=SpeculativeConfig(method="mtp", disable_by_batch_size=2),
        ),
    )
    router: RouterConfig = RouterConfig()
    fallback: FallbackConfig = FallbackConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    max_connections_per_tier: Annotated[int, Field(ge=1)] = 256
    # An idle pooled connection is dropped before the tier's server would close it (uvicorn,
    # so vLLM and ours: 5 s), so a request never races the server's close on a stale one.
    tier_keepalive_s: Seconds = 4.0
    # How long the gateway keeps an idle client connection open: longer than a load
    # balancer's idle timeout (60 s on common ones), for the same reason in reverse.
    keepalive_timeout_s: Seconds = 75.0
    drain_timeout_s: Seconds = 30.0  # in-flight requests may finish this long after SIGTERM

    @model_validator(mode="after")
    def _check_names(self) -> "GatewayConfig":
        full, highspeed = self.tiers.full.model_name, self.tiers.highspeed.model_name
        if full == highspeed:
            raise ValueError(f"both tiers serve the model name {full!r}; give them distinct names")
        tiers = (self.tiers.full, self.tiers.highspeed)
        ports = [t.port for t in tiers if isinstance(t, SupervisedTier) and t.port is not None]
        if len(set(ports)) < len(ports) or self.port in ports:
            raise ValueError("the gateway and the tiers it starts need distinct ports")
        return self


class GatewayConfigError(ValueError):
    """A config file that cannot be read or does not validate; the message says where."""


def check_checkpoints(config: GatewayConfig) -> None:
    """Refuse to start an embedded tier whose checkpoint is not there or does not agree with
    its config.json (an FP4 checkpoint's codes and scales), or whose device or dtype this
    machine lacks, or a vllm tier without its interpreter or checkpoint, rather than restart
    it forever."""
    for tier in ("full", "highspeed"):
        tier_config = getattr(config.tiers, tier)
        if isinstance(tier_config, VllmTier):
            _check_vllm_tier(tier, tier_config)
        if not isinstance(tier_config, EmbeddedTier):
            continue
        if not (tier_config.model / "config.json").is_file():
            raise GatewayConfigError(
                f"tiers.{tier}.model: {tier_config.model} is not a checkpoint directory (no "
                "config.json); the default tiers are the trained demo models, which "
                "`training/` produces: give other checkpoints with --config"
            )
        try:
            saved = check_checkpoint(tier_config.model)
            device = resolve_device(tier_config.device)
            dtype = resolve_dtype(tier_config.dtype, saved, device)
            resolve_kv_cache_dtype(tier_config.kv_cache_dtype, dtype, device)
        except (CheckpointError, UnsupportedDtypeError, UnsupportedDeviceError) as e:
            raise GatewayConfigError(f"tiers.{tier}: {e}") from e


def _check_vllm_tier(tier: str, config: VllmTier) -> None:
    """A vLLM tier whose interpreter or checkpoint is missing would fail at every restart;
    vLLM itself checks the rest (the checkpoint's format, the flags) as it starts."""
    if not (config.python.is_file() and os.access(config.python, os.X_OK)):
        raise GatewayConfigError(
            f"tiers.{tier}.python: {config.python} is not an executable; a vllm tier runs "
            "vLLM's OpenAI server with the interpreter of the environment vLLM is installed in "
            "(docs/deploying.md)"
        )
    if not (config.model / "config.json").is_file():
        raise GatewayConfigError(
            f"tiers.{tier}.model: {config.model} is not a checkpoint directory (no config.json)"
        )


def load_config(path: Path | None) -> GatewayConfig:
    if path is None:
        return GatewayConfig()
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise GatewayConfigError(f"{path}: {e}") from e
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as e:
        lines = [
            f"  {'.'.join(map(str, err['loc'])) or '(top level)'}: {err['msg']}"
            for err in e.errors()
        ]
        raise GatewayConfigError(f"{path}: invalid config\n" + "\n".join(lines)) from e
