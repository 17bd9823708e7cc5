"""Keep freed host memory in the process, so a CPU step does not page-fault its tensors in again
every step.

glibc's malloc serves large blocks with `mmap` and hands them back on free; its threshold
adapts upward after a free, but the top of the heap is trimmed back to the OS past twice the
threshold. A CPU decode step allocates and frees the same tens of MB every step (gathered keys
and values, activations, logits), so with the defaults each step faults them in anew, which
dominated a 64-sequence rollout's time (`loadtests/bench_rollouts.py`). PyTorch's CPU tuning
guide prescribes a caching allocator (jemalloc or tcmalloc by `LD_PRELOAD`) for this; fixing
glibc's own thresholds does the same for blocks of up to 32 MB (glibc's largest mmap
threshold) with nothing to preload. Larger blocks are still mapped per allocation: preload
jemalloc for shapes past that.
"""

import ctypes

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit
TRIM_THRESHOLD = 1 << 30  # freed memory at the heap's top the process keeps

_retained = False


def retain_freed_memory() -> bool:
    """Set glibc's thresholds once per process; False where malloc is not glibc's (no
    `mallopt`, e.g. macOS) or it refuses them, which leaves the defaults: slower, not wrong."""
    global _retained
    if not _retained:
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
        _retained = bool(
            mallopt is not None
            and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        )
    return _retained
