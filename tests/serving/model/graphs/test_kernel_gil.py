"""Compiled decode steps run without the GIL (inductor's C++ wrapper, `inductor_config`,
releases it for the whole call), so the server's event loop streams tokens while a step
computes; a kernel's error still raises."""

import threading
import time

import pytest
import torch

from serving.model.graphs.inductor_setup import inductor_config


def compiled(fn):
    """`fn` compiled as the decode steps are, on its first call (inside the config)."""
    graph = torch.compile(fn, dynamic=False)

    def call(*args):
        with inductor_config():
            return graph(*args)

    return call


def test_other_threads_run_while_a_step_does():
    project = compiled(lambda x, w: (x.unsqueeze(-2) * w).sum(-1))
    x, w = torch.randn(96, 1024), torch.randn(3000, 1024)
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())

    with torch.inference_mode():
        torch.testing.assert_close(project(x, w), x @ w.t(), rtol=1e-4, atol=1e-3)  # compiled
        ticker = threading.Thread(target=tick)
        ticker.start()
        start = time.perf_counter()
        project(x, w)  # one kernel call of ~100 ms on this machine
        end = time.perf_counter()
        stop.set()
        ticker.join()
    margin = (end - start) / 4
    inside = [t for t in ticks if start + margin < t < end - margin]
    assert end - start > 0.02, "the kernel must run long enough to tell"
    assert len(inside) > 100  # holding the GIL, the ticker could not run at all in there


def test_a_kernels_error_still_raises():
    pick = compiled(lambda t, i: t[i] * 2)
    with torch.inference_mode():
        assert pick(torch.arange(8.0), torch.tensor([1, 2])).tolist() == [2.0, 4.0]
        with pytest.raises(RuntimeError, match="index out of bounds"):
            pick(torch.arange(8.0), torch.tensor([1, 20]))
        assert pick(torch.arange(8.0), torch.tensor([3, 0])).tolist() == [6.0, 0.0]
