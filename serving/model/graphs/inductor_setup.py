"""How this process's inductor is set up for the decode graphs (`decode.py`): where
its caches live on disk, its config while the graphs compile, the GIL its kernels release,
and its import, which a standby engine does ahead of time."""

import contextlib
import os
from pathlib import Path

import torch


def compile_cache_dir() -> Path:
    """`$TIERSERVE_CACHE_DIR/inductor`, default `~/.cache/tierserve/inductor`."""
    root = os.environ.get("TIERSERVE_CACHE_DIR") or Path.home() / ".cache" / "tierserve"
    return Path(root) / "inductor"


def import_compiler() -> None:
    """Import dynamo and inductor, most of a warm start's compile thread, whose graphs then
    load from disk in a fraction of a second each: a standby engine (`tierserve engine
    --standby`) does it before it waits. On the calling thread, with no other thread
    importing: two threads importing torch's modules at once can fail on their cycles."""
    import torch._dynamo
    import torch._inductor.compile_fx  # noqa: F401


def inductor_config(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Half precision: frozen weights and inductor's own C++ GEMMs for the projections.

    A bf16 or fp16 product on a CPU goes to oneDNN, whose fixed cost a call, however small the
    product, is several times MKL's fp32 call at a decode step's sizes: most of a one-stream
    step. Frozen, the
    weights are graph constants that inductor repacks for its C++ GEMM template (AMX, AVX-512
    or AVX2 micro-kernels), the only backend offered, so nothing is benchmarked at compile
    time (with oneDNN's as a second choice, autotuning kept it for some products and steps of
    a few sequences were slower). The price, paid only in half precision: each graph
    holds its own packed copy of the dense weights (the experts are read in place), and a
    restart does more work: frozen graphs do hit inductor's FX graph cache (PyTorch allows it
    outside Meta), but the AOT autograd cache refuses any graph compiled with freezing, so each
    start traces them again, refolds and repacks the weights before the cache lookup, and
    their weights, being graph constants, keep them out of `precompiled`'s whole-graph store.
    fp32 gains nothing from freezing (`loadtests/profile_decode.py` times a step), so it keeps
    both caches. The config is process-wide, so it is set only while this thread compiles.

    Every dtype's graphs are generated without inductor's checks of each input's and each
    library call's sizes, strides and alignment, which it makes on every call of every step.
    A graph runs only on the inputs it was traced for, the model's own tensors and the step's
    fixed buffers, which its guards check.

    fp32 graphs are driven by inductor's C++ wrapper rather than its Python one: a one-row
    step is some forty kernels and library calls, and between them the Python wrapper's
    allocations and calls kept the step's other OpenMP thread waiting, a share of every step
    (`loadtests/profile_decode.py`). The C++ wrapper calls the ops through the dispatcher and
    releases the GIL for the whole step itself. Half-precision graphs keep the Python wrapper:
    this machine's CPUs compute them in fp32, so their C++-wrapped form was never run."""
    from torch._inductor import config  # imported in the compile thread, as dynamo is

    unchecked = {"size_asserts": False, "alignment_asserts": False}
    if dtype == torch.float32:
        return config.patch(unchecked | {"cpp_wrapper": True})
    half = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
    return config.patch(unchecked | half)


def release_gil_in_kernels() -> None:
    """Make inductor's C++ kernels release the GIL while they run, as ATen's ops do.

    Inductor's Python binding of a CPU kernel parses its arguments and calls it holding the
    GIL (`CppPythonBindingsCodeCache` in `torch/_inductor/codecache.py`), so while a compiled
    decode step runs, the server's event loop cannot stream the previous step's tokens. The
    binding here parses the arguments first, then releases the GIL around the kernel, and
    takes it back on the way out, exceptions included (a kernel's bounds checks throw).
    Process-wide; the generated source differs, so the compile cache keys do too. Graphs
    under the C++ wrapper (fp32) need none of it: theirs releases the GIL for the whole step."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache as bindings

    bindings.extra_parse_arg = """
        struct ReleasedGIL {{
            PyThreadState* state = PyEval_SaveThread();
            ~ReleasedGIL() {{ PyEval_RestoreThread(state); }}
        }};
        template <typename F, typename... A> static inline void call_without_gil(F f, A... a) {{
            ReleasedGIL released;
            f(a...);
        }}
    """
    bindings.call_entry_function = "call_without_gil(kernel, {}); Py_RETURN_NONE;"
