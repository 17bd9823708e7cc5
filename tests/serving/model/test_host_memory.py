import resource
import sys

import pytest
import torch

from serving.model.host_memory import retain_freed_memory


def churn() -> None:
    """Decode steps' temporaries: a few tensors of 8-13 MB, a little larger every step as
    the contexts grow, each freed before the next step."""
    for i in range(20):
        tensors = [torch.ones((2 << 20) + i * (64 << 10)) for _ in range(3)]
        del tensors


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_step_tensors_are_not_faulted_in_again():
    """With glibc's defaults the second round faults every page in again; with the memory
    retained, none but stragglers. Counted for this thread alone: a test worker's other
    threads (a graph compiling in the background) fault pages of their own meanwhile."""
    assert retain_freed_memory()
    churn()  # the heap grows once
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    churn()
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert faults < 1000, faults
