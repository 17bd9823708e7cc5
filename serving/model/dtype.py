"""vLLM's `--dtype` and `--kv-cache-dtype`: the torch dtype of weights and activations, and of
the KV cache. Logits, softmax and sampling stay fp32 whatever the model computes in.

A dtype the CPU has no native matmul for (oneDNN's check: AVX512-BF16/AMX for bfloat16,
AVX512-FP16/AMX-FP16 for float16) is refused rather than emulated: emulation is several
times slower than fp32, which is never what someone asking for half precision wants.
"""

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_CHOICES = ("auto", *DTYPES)


class UnsupportedDtypeError(ValueError):
    """A dtype that is unknown, or that this machine cannot compute in natively."""


def resolve_dtype(name: str, checkpoint_dtype: str | None) -> torch.dtype:
    """`auto` is the checkpoint's `dtype` (`torch_dtype` in older configs), fp32 if unset."""
    if name == "auto":
        name = checkpoint_dtype or "float32"
    if name not in DTYPES:
        raise UnsupportedDtypeError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    check_supported(dtype)
    return dtype


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`auto` is the model's dtype."""
    return model_dtype if name == "auto" else resolve_dtype(name, None)


def check_supported(dtype: torch.dtype) -> None:
    supported = {
        torch.float32: True,
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    }
    if not supported[dtype]:
        name = str(dtype).removeprefix("torch.")
        raise UnsupportedDtypeError(
            f"--dtype {name}: this CPU has no native {name} matmul; use another --dtype"
        )
