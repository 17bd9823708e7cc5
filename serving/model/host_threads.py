"""Torch's threads on a CPU: only the thread that steps the engine keeps OpenMP workers.

OpenMP (libgomp, torch's runtime) keeps a pool of workers for every thread that has run a
parallel region, for as long as that thread lives. When a process's pools hold more threads
than the machine has cores, libgomp stops spinning between regions ("throttled": 100 spins)
and sleeps its workers, so every region pays a futex wake-up. A compiled decode step runs
dozens of regions (each inductor kernel is one), so a one-stream step stepped on a thread of
its own ran several times slower when the main thread had loaded the model (its pool alive)
than when it had not (`loadtests/bench_api.py` steps an engine this way). So a server builds
its engine on a passing thread (`build_off_thread`), whose pool goes with it, and each thread
that steps sets its own count (`TorchThreads`: `torch.set_num_threads` is per thread, as
OpenMP's team size and MKL's threads are).
"""

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class TorchThreads:
    """The thread count of the thread that made this, applied to each thread that runs steps."""

    def __init__(self) -> None:
        self.num_threads = torch.get_num_threads()
        self._stepper: int | None = None  # the thread that stepped last, already configured

    def adopt(self) -> None:
        """Configure the calling thread unless it stepped last (one comparison a step)."""
        ident = threading.get_ident()
        if ident != self._stepper:
            torch.set_num_threads(self.num_threads)
            self._stepper = ident


def build_off_thread(factory: Callable[[], T]) -> T:
    """`factory()` (loading a model, building an engine) on a thread that exits when it is
    done, with the caller's torch thread count; its exceptions are raised here."""
    num_threads = torch.get_num_threads()
    result: list[T] = []
    error: list[BaseException] = []

    def build() -> None:
        torch.set_num_threads(num_threads)
        try:
            result.append(factory())
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=build, name="build-engine")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
