"""vLLM's `--dtype` and `--kv-cache-dtype`: the torch dtype of weights and activations, and of
the KV cache. Logits, softmax and sampling stay fp32 whatever the model computes in.

A dtype the device has no native matmul for (on a CPU, oneDNN's check: AVX512-BF16/AMX for
bfloat16, AVX512-FP16/AMX-FP16 for float16; on a GPU, bfloat16 before Ampere) is refused rather
than emulated: emulation is several times slower than fp32, which is never what someone asking
for half precision wants.
"""

import torch

from serving.model.device import CPU

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_CHOICES = ("auto", *DTYPES)


class UnsupportedDtypeError(ValueError):
    """A dtype that is unknown, or that this machine cannot compute in natively."""


def resolve_dtype(
    name: str, checkpoint_dtype: str | None, device: torch.device = CPU
) -> torch.dtype:
    """`auto` is the checkpoint's `dtype` (`torch_dtype` in older configs), fp32 if unset."""
    if name == "auto":
        name = checkpoint_dtype or "float32"
    if name not in DTYPES:
        raise UnsupportedDtypeError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    check_supported(dtype, device)
    return dtype


def resolve_kv_cache_dtype(
    name: str, model_dtype: torch.dtype, device: torch.device = CPU
) -> torch.dtype:
    """`auto` is the model's dtype."""
    return model_dtype if name == "auto" else resolve_dtype(name, None, device)


def check_supported(dtype: torch.dtype, device: torch.device = CPU) -> None:
    if device.type == "cuda":
        supported = dtype != torch.bfloat16 or torch.cuda.is_bf16_supported(False)
    else:
        supported = {
            torch.float32: True,
            torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
            torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported(),
        }[dtype]
    if not supported:
        name = str(dtype).removeprefix("torch.")
        where = "GPU" if device.type == "cuda" else "CPU"
        raise UnsupportedDtypeError(
            f"--dtype {name}: this {where} has no native {name} matmul; use another --dtype"
        )
