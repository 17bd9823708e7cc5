"""Building the C++ CPU ops of `kernels/csrc/` with `torch.utils.cpp_extension`, shared by
the paged decode attention (`cpu_attention.py`), the FP4 products (`cpu_fp4.py`) and the
dense ones (`cpu_dense.py`).

The ops are one library, one translation unit (`csrc/ops.cpp` includes each op's source), so
the headers they share compile once. They are written against PyTorch's stable ABI headers
(`torch/csrc/stable`) and their own vector helpers (`csrc/simd.h`), not ATen's: ATen's tensor,
dispatcher and vector headers took most of a build, which every tier of a fresh machine pays
before it is ready. The library is compiled on first use (ninja and the machine's C++
compiler, a few seconds) into torch's extension cache (`$TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`), then loaded from there in well under a second. It is built for
the machine's own instruction set (`-march=native`): a cache directory shared by machines of
different CPUs needs `TORCH_EXTENSIONS_DIR` set per kind of machine. The library is named
after the capability it is built for, so a process run at another capability
(`ATEN_CPU_CAPABILITY=default`, as the tests do) builds and loads its own copy instead of
rebuilding the other, and after the source's path and flags: the build commands name the
source by its path, so checkouts sharing one extension cache under one name rebuilt each
other's library at every tier start.
"""

import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")

CSRC = Path(__file__).parent / "csrc"
NAME, SOURCE = "tierserve_cpu_ops", "ops.cpp"


def capability() -> str:
    """The capability PyTorch's own CPU kernels use here (AVX512, AVX2), else DEFAULT: the
    ops' portable vectors (`csrc/simd.h`). `ATEN_CPU_CAPABILITY` lowers it."""
    found = torch.backends.cpu.get_cpu_capability()
    return found if found in ("AVX512", "AVX2") else "DEFAULT"


def flags() -> list[str]:
    """The machine's instruction set and the vector code built for `capability()`.

    No OpenMP: `torch::stable::parallel_for` runs its region inside libtorch, on torch's own
    threads, so nothing of the runtime is compiled into the ops."""
    cap = capability()
    return ["-O3", "-march=native", f"-DCPU_CAPABILITY={cap}"] + (
        [f"-DCPU_CAPABILITY_{cap}"] if cap != "DEFAULT" else []
    )


def library_name() -> str:
    """The built library's name: `NAME`, the capability it is compiled for, and a hash of the
    source's path and the flags (one build per checkout and flags)."""
    key = f"{(CSRC / SOURCE).resolve()}|{' '.join(flags())}"
    return f"{NAME}_{capability().lower()}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def load() -> str | None:
    """Build (or load the built) `csrc/ops.cpp` as the library `library_name()`, which
    registers the ops with torch: None, or why it could not be built."""
    from torch.utils import cpp_extension  # imported where it is used: ~0.3 s

    try:
        cpp_extension.load(
            library_name(), [str(CSRC / SOURCE)], extra_cflags=flags(), is_python_module=False
        )
    except (OSError, RuntimeError) as exc:  # no compiler or ninja, or a failed build
        lines = str(exc).splitlines() or [type(exc).__name__]
        return next((line for line in lines if "error" in line), lines[0]).strip()
    return None


def once(fn: Callable[[], T]) -> Callable[[], T]:
    """`fn` called on the first call, once a process (threads racing to it wait for the
    first), then its answer from a plain variable, which a graph being traced reads as a
    constant. So the first call comes before any trace that reads it (`DecodeGraphs` makes
    it): a trace cannot take the lock or build a library, and says so."""
    lock = threading.Lock()
    done = False
    result: T
    name = fn.__qualname__

    def call() -> T:
        nonlocal done, result
        if not done:
            if torch.compiler.is_compiling():
                raise RuntimeError(f"{name}() was first called by a graph being traced")
            with lock:
                if not done:
                    result = fn()
                    done = True
        return result

    return call


# The library built or loaded once a process, for every op's module: None, or why not.
built = once(load)


class Library(NamedTuple):
    """One module's ops in the library: their fake kernels, for the compiled decode steps that
    call them, and what runs instead where the library cannot be built."""

    register_fakes: Callable[[], None]
    instead: str


def built_once(library: Library) -> Callable[[], bool]:
    """The `available()` of a module's ops: on the first call, `built()` and then its fake
    kernels registered, or one warning saying what runs `instead`."""

    def available() -> bool:
        failure = built()
        if failure is not None:
            logger.warning(
                "the C++ ops (%s) could not be built (%s); %s", SOURCE, failure, library.instead
            )
            return False
        library.register_fakes()
        return True

    return once(available)
