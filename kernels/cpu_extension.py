"""Building the C++ CPU ops of `kernels/csrc/` with `torch.utils.cpp_extension`, shared by
the paged decode attention (`cpu_attention.py`), the FP4 products (`cpu_fp4.py`) and the
dense ones (`cpu_dense.py`).

An op is compiled on first use (ninja and the machine's C++ compiler, about 10 s) into
torch's extension cache (`$TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`), then
loaded from there in well under a second. It is built for the machine's own instruction set
(`-march=native`): a cache directory shared by machines of different CPUs needs
`TORCH_EXTENSIONS_DIR` set per kind of machine. Each library is named after the capability
it is built for, so a process run at another capability (`ATEN_CPU_CAPABILITY=default`, as
the tests do) builds and loads its own copy instead of rebuilding the other, and after the
source's path and flags: the build commands name the source by its path, so checkouts sharing
one extension cache under one name rebuilt each other's library at every tier start.
"""

import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"


def capability() -> str:
    """The capability PyTorch's own CPU kernels use here (AVX512, AVX2), else DEFAULT: ATen's
    portable vector types. `ATEN_CPU_CAPABILITY` lowers it."""
    found = torch.backends.cpu.get_cpu_capability()
    return found if found in ("AVX512", "AVX2") else "DEFAULT"


def flags() -> list[str]:
    """The machine's instruction set, ATen's vector types built for `capability()`, and OpenMP.

    `at::parallel_for` is an OpenMP region compiled into the caller: without -fopenmp it runs
    on one thread whatever `torch.set_num_threads` says (the attention op took as long on two
    threads as on one). The region runs on the OpenMP runtime torch has loaded (its
    libgomp.so.1, by soname), so the ops' threads are torch's own."""
    cap = capability()
    return ["-O3", "-march=native", "-fopenmp", f"-DCPU_CAPABILITY={cap}"] + (
        [f"-DCPU_CAPABILITY_{cap}"] if cap != "DEFAULT" else []
    )


def library_name(name: str, source: str) -> str:
    """The built library's name: `name`, the capability it is compiled for, and a hash of the
    source's path and the flags (one build per checkout and flags)."""
    key = f"{(CSRC / source).resolve()}|{' '.join(flags())}"
    return f"{name}_{capability().lower()}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def load(name: str, source: str, register_fakes: Callable[[], None], instead: str) -> bool:
    """Build (or load the built) `csrc/<source>` as the library `library_name(...)`, which
    registers its ops with torch, then `register_fakes()` for the compiled decode steps that
    call them. False, with one warning saying what runs `instead`, where it cannot be built."""
    from torch.utils import cpp_extension  # imported where it is used: ~0.3 s

    try:
        cpp_extension.load(
            library_name(name, source),
            [str(CSRC / source)],
            extra_cflags=flags(),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except (OSError, RuntimeError) as exc:  # no compiler or ninja, or a failed build
        lines = str(exc).splitlines() or [type(exc).__name__]
        reason = next((line for line in lines if "error" in line), lines[0])
        logger.warning("the C++ op %s could not be built (%s); %s", source, reason.strip(), instead)
        return False
    register_fakes()
    return True


class Library(NamedTuple):
    """A library of C++ ops: `load`'s arguments."""

    name: str
    source: str
    register_fakes: Callable[[], None]
    instead: str


def built_once(library: Library) -> Callable[[], bool]:
    """The `available()` of a library: `load`s it on the first call, once a process (threads
    racing to it wait for the first), then answers from a plain variable, which a graph being
    traced reads as a constant (the lock is taken only before the first build)."""
    lock = threading.Lock()
    built: bool | None = None

    def available() -> bool:
        nonlocal built
        if built is None:
            with lock:
                if built is None:
                    built = load(*library)
        return built

    return available
