"""vLLM's `--dtype` and `--kv-cache-dtype`: the torch dtype of weights and activations, and of
the KV cache. Logits, softmax and sampling stay fp32 whatever the model computes in.

A dtype the device has no native matmul for (on a CPU, oneDNN's check: AVX512-BF16/AMX for
bfloat16, AVX512-FP16/AMX-FP16 for float16; on a GPU, bfloat16 before Ampere) is refused rather
than emulated: emulation is several times slower than fp32, which is never what someone asking
for half precision wants. `auto` on such a checkpoint falls back instead, as vLLM's does.
"""

import functools
import logging

import torch

from serving.model.device import CPU

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_CHOICES = ("auto", *DTYPES)


class UnsupportedDtypeError(ValueError):
    """A dtype that is unknown, or that this machine cannot compute in natively."""


def resolve_dtype(
    name: str, checkpoint_dtype: str | None, device: torch.device = CPU
) -> torch.dtype:
    """`auto` is the checkpoint's `dtype` (`torch_dtype` in older configs), fp32 if unset.

    As vLLM's `auto`: where the device has no native matmul for the checkpoint's dtype, it
    computes in float16 on a GPU and float32 on a CPU instead, and says so in a warning (a
    bf16 checkpoint still serves on a CPU without AVX512-BF16). A dtype named explicitly is
    refused instead."""
    explicit = name != "auto"
    if not explicit:
        name = checkpoint_dtype or "float32"
    if name not in DTYPES:
        raise UnsupportedDtypeError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    if is_supported(dtype, device):
        return dtype
    where = "GPU" if device.type == "cuda" else "CPU"
    if explicit:
        raise UnsupportedDtypeError(
            f"--dtype {name}: this {where} has no native {name} matmul; use another --dtype"
        )
    fallback = torch.float16 if device.type == "cuda" else torch.float32
    _warn_fallback(name, where, str(fallback).removeprefix("torch."))
    return fallback


@functools.cache
def _warn_fallback(name: str, where: str, fallback: str) -> None:
    """Once a process: the gateway resolves each tier's dtypes before its engines do."""
    logger.warning(
        "--dtype auto: the checkpoint is %s, which this %s has no native matmul for; "
        "computing in %s",
        name,
        where,
        fallback,
    )


def resolve_kv_cache_dtype(
    name: str, model_dtype: torch.dtype, device: torch.device = CPU
) -> torch.dtype:
    """`auto` is the model's dtype. On a CPU a named dtype is only how keys and values are
    stored: attention widens them to the model's dtype as it reads them, exactly, so a CPU
    with no native bf16 products still keeps a bf16 cache, half the bytes a long context
    reads each step. On a GPU the cache's dtype is the attention kernels' operand dtype, so it
    must be one the GPU computes in."""
    if name == "auto":
        return model_dtype
    if device.type == "cuda":
        return resolve_dtype(name, None, device)
    if name not in DTYPES:
        raise UnsupportedDtypeError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def is_supported(dtype: torch.dtype, device: torch.device = CPU) -> bool:
    if device.type == "cuda":
        return dtype != torch.bfloat16 or torch.cuda.is_bf16_supported(False)
    return {
        torch.float32: True,
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    }[dtype]
