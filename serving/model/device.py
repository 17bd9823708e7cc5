"""`--device auto|cpu|cuda`: where a model's weights, its KV cache, the step's inputs and
sampling live. `auto` is the GPU when there is one. Everything else follows the device of the
loaded weights, so the CPU and the GPU run one code path; which kernels run on it is decided
in `kernels/ops.py`.
"""

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")
CPU = torch.device("cpu")


class UnsupportedDeviceError(ValueError):
    """A device that is unknown or that this machine does not have."""


def resolve_device(name: str) -> torch.device:
    """`auto`: CUDA when present, else the CPU. Asking for CUDA without it is an error rather
    than a quiet run on the CPU, which would be many times slower than what was asked for."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in DEVICE_CHOICES:
        raise UnsupportedDeviceError(f"device {name!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise UnsupportedDeviceError(
            f"--device cuda: no CUDA GPU is available (torch {torch.__version__}, {build}); "
            "use --device cpu or auto"
        )
    return torch.device(name)


def kv_cache_budget(device: torch.device, gpu_memory_utilization: float) -> int:
    """Bytes the KV cache may take on a GPU, as vLLM's `--gpu-memory-utilization` means it:
    that share of the device's memory for this engine, less what this process already holds
    once the weights are loaded, and never more than is free (two tiers can share a GPU with
    0.45 each). Unlike vLLM no forward pass is profiled: activations and CUDA graphs live in
    the share left over."""
    torch.cuda.empty_cache()  # loading's temporaries: cached by torch, yet free for the cache
    free, total = torch.cuda.mem_get_info(device)
    share = int(total * gpu_memory_utilization) - torch.cuda.memory_reserved(device)
    return min(share, free)
