"""A tier's `dtype` and `enforce_eager` reach its engine's command line, and a dtype the CPU
lacks stops the gateway before it starts anything."""

from pathlib import Path

import pytest

from serving.cli import build_parser, command_modules
from serving.gateway.config import GatewayConfig, GatewayConfigError, check_checkpoints
from serving.gateway.supervisor import engine_command


def _config(model: Path, dtype: str, kv_cache_dtype: str = "auto") -> GatewayConfig:
    tier = {"model": str(model), "dtype": dtype, "kv_cache_dtype": kv_cache_dtype}
    fast = tier | {"served_model_name": "fast"}
    return GatewayConfig.model_validate({"tiers": {"full": tier, "highspeed": fast}})


@pytest.mark.usefixtures("any_dtype_native")
def test_tier_dtype_is_passed_to_the_engine(random_checkpoint: Path) -> None:
    config = _config(random_checkpoint, "bfloat16")
    check_checkpoints(config)
    command = engine_command(config.tiers.full, 8123)
    args = build_parser(command_modules()).parse_args(command[command.index("engine") :])
    assert (args.dtype, args.kv_cache_dtype) == ("bfloat16", "auto")
    assert not args.enforce_eager  # tiers compile their decode steps by default, as vLLM


def test_tier_enforce_eager_is_passed_to_the_engine(random_checkpoint: Path) -> None:
    config = _config(random_checkpoint, "auto")
    tier = config.tiers.full.model_copy(update={"enforce_eager": True})
    command = engine_command(tier, 8123)
    args = build_parser(command_modules()).parse_args(command[command.index("engine") :])
    assert args.enforce_eager


def test_a_tier_dtype_the_cpu_lacks_is_a_config_error(
    random_checkpoint: Path, no_native_float16: None
) -> None:
    with pytest.raises(GatewayConfigError, match=r"tiers\.full: .*float16"):
        check_checkpoints(_config(random_checkpoint, "float16"))


def test_a_half_precision_kv_cache_needs_no_native_products(
    random_checkpoint: Path, no_native_float16: None
) -> None:
    """The cache is storage: an fp32 tier keeps an fp16 one where the CPU computes no fp16."""
    config = _config(random_checkpoint, "float32", kv_cache_dtype="float16")
    check_checkpoints(config)
    command = engine_command(config.tiers.full, 8123)
    args = build_parser(command_modules()).parse_args(command[command.index("engine") :])
    assert args.kv_cache_dtype == "float16"
