import mmap
import resource
import sys

import pytest
import torch

from serving.model.host_memory import retain_freed_memory


def churn() -> int:
    """Decode steps' temporaries: a few tensors of 8-13 MB, a little larger every step as
    the contexts grow, each freed before the next step. The pages they touch."""
    touched = 0
    for i in range(20):
        tensors = [torch.ones((2 << 20) + i * (64 << 10)) for _ in range(3)]
        touched += sum(t.nbytes for t in tensors) // mmap.PAGESIZE
        del tensors
    return touched


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_step_tensors_are_not_faulted_in_again():
    """With glibc's defaults the second round faults pages in again: a tensor past malloc's
    adaptive mmap threshold is mapped anew, and the heap's top is trimmed back to the OS
    between steps. With the memory retained, none but stragglers (a test worker's heap holds
    other tests' blocks, so a tensor can land on fresh pages). Counted for this thread
    alone: a test worker's other threads (a graph compiling in the background) fault pages
    of their own meanwhile."""
    assert retain_freed_memory()
    churn()  # the heap grows once
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    touched = churn()
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert faults < touched / 40, (faults, touched)  # with glibc's defaults, measured: about / 15
