"""How this process's inductor is set up for the decode graphs (`decode.py`): where
its caches live on disk, its config while the graphs compile, and its import, which a standby
engine does ahead of time."""

import contextlib
import os
from pathlib import Path


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


def inductor_config() -> contextlib.AbstractContextManager:
    """Inductor's config while the decode graphs compile, every dtype alike.

    The graphs are generated without inductor's checks of each input's and each library
    call's sizes, strides and alignment, which it makes on every call of every step. A graph
    runs only on the inputs it was traced for, the model's own tensors and the step's fixed
    buffers, which its guards check.

    They are driven by inductor's C++ wrapper rather than its Python one: a one-row step is
    some forty kernels and library calls, and between them the Python wrapper's allocations
    and calls kept the step's other OpenMP thread waiting, a share of every step
    (`loadtests/profile_decode.py`). The C++ wrapper calls the ops through the dispatcher and
    releases the GIL for the whole step itself.

    No freezing: a half-precision step's products are the dense C++ ops, as an fp32 step's
    are (`serving/model/linear.py`). Its products as oneDNN's bf16 calls cost most of a
    one-stream step in their fixed cost a call, and inductor's own GEMMs, which spare it,
    need the weights frozen into each graph: a packed copy of them in every graph, and graphs
    that neither inductor's AOT autograd cache nor `precompiled`'s store would keep. The
    config is process-wide, so it is set only while this thread compiles."""
    from torch._inductor import config  # imported in the compile thread, as dynamo is

    return config.patch({"size_asserts": False, "alignment_asserts": False, "cpp_wrapper": True})
