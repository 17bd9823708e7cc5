"""Decode attention over the paged KV cache on a CPU: a C++ op (`csrc/paged_attention.cpp`)
that reads each sequence's keys and values through its block table where they lie, as the
Triton kernel does on a GPU and vLLM's CPU backend does in its own C++.

It replaced SDPA's flash kernel on a gathered copy of the cache (`index_select` of every
block, then one batched call) with cascade attention for decodes sharing prompt blocks. At the
rollouts' shape (64 decodes, 8 prompts x 8 samples, 100-400 keys) the copies cost nearly as
much as the attention: a step took 39 ms that way and takes 26 ms reading in place (one
thread; `python loadtests/bench_rollouts.py`: 1.55-1.86x transformers before, 2.64-3.13x after;
with the block prefetch and OpenMP threads of `csrc/paged_attention.cpp` since, median 3.26x).

The op is compiled on first use by `torch.utils.cpp_extension` (ninja and the machine's C++
compiler, about 10 s) into torch's extension cache (`$TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`), then loaded from there in well under a second. It is built for
the machine's own instruction set (`-march=native`): a cache directory shared by machines of
different CPUs needs `TORCH_EXTENSIONS_DIR` set per kind of machine.
"""

import functools
import hashlib
import logging
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"


def _flags() -> list[str]:
    """The machine's instruction set, ATen's vector types built for the capability PyTorch's
    own kernels use here (AVX512, AVX2; elsewhere ATen's portable DEFAULT), and OpenMP.

    `at::parallel_for` is an OpenMP region compiled into the caller: without -fopenmp it runs
    on one thread whatever `torch.set_num_threads` says (the op took as long on two threads
    as on one). The region runs on the OpenMP runtime torch has loaded (its libgomp.so.1, by
    soname), so the op's threads are torch's own."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX512", "AVX2"):
        capability = "DEFAULT"
    return ["-O3", "-march=native", "-fopenmp", f"-DCPU_CAPABILITY={capability}"] + (
        [f"-DCPU_CAPABILITY_{capability}"] if capability != "DEFAULT" else []
    )


_lock = threading.Lock()


def _build_name() -> str:
    """The extension's name, and so its build directory: one per checkout and flags. Its
    build commands name the source by its path, so checkouts sharing one extension cache
    under one name rebuilt each other's build at every start (seconds to tens of seconds of a
    tier's start, and of its restart after a crash)."""
    key = f"{SOURCE.resolve()}|{' '.join(_flags())}"
    return "tierserve_cpu_ops_" + hashlib.sha256(key.encode()).hexdigest()[:12]


@functools.cache
def _load() -> bool:
    from torch.utils import cpp_extension  # imported where it is used: ~0.3 s

    try:
        cpp_extension.load(
            _build_name(),
            [str(SOURCE)],
            extra_cflags=_flags(),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except (OSError, RuntimeError) as exc:  # no compiler or ninja, or a failed build
        lines = str(exc).splitlines() or [type(exc).__name__]
        reason = next((line for line in lines if "error" in line), lines[0])
        logger.warning(
            "the C++ paged decode attention could not be built (%s); decode attention "
            "runs as SDPA over gathered blocks instead, slower",
            reason.strip(),
        )
        return False
    # What the op returns, for the compiled decode steps that call it (`torch.compile`).
    torch.library.register_fake("tierserve_cpu::paged_decode_attention")(
        lambda q, k_cache, v_cache, block_tables, context_lens, scale: torch.empty_like(q)
    )
    return True


def available() -> bool:
    """Builds or loads the op once a process; False, with one warning, where it cannot be
    built (then `serving/model/attention.py` gathers the blocks for SDPA)."""
    with _lock:
        return _load()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, heads, d] (one token per sequence), caches [blocks, block_size, kv_heads, d] in
    fp32, bf16 or fp16, block_tables [B, max_blocks] (padding never read), context_lens [B]
    (each >= 1) -> [B, heads, d] in q's dtype; scores and sums in fp32."""
    out = torch.ops.tierserve_cpu.paged_decode_attention(
        q.float().contiguous(), k_cache, v_cache, block_tables, context_lens, scale
    )
    return out.to(q.dtype)
