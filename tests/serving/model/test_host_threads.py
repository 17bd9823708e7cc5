"""Torch threads on a CPU: a thread that steps an engine runs with the thread count of the one
that built it, and an engine can be built on a passing thread."""

import threading

import pytest
import torch

from serving.model.host_threads import TorchThreads, build_off_thread


def test_a_stepping_thread_adopts_the_builders_thread_count():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        threads = TorchThreads()
    finally:
        torch.set_num_threads(before)
    seen: list[int] = []

    def step() -> None:
        torch.set_num_threads(3)  # whatever the thread had
        threads.adopt()
        seen.append(torch.get_num_threads())
        torch.set_num_threads(3)
        threads.adopt()  # once per thread: the second call leaves it alone
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=step)
    t.start()
    t.join()
    assert seen == [1, 3]


def test_build_off_thread_returns_or_raises_what_the_factory_does():
    main = threading.get_ident()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ident, count = build_off_thread(lambda: (threading.get_ident(), torch.get_num_threads()))
    finally:
        torch.set_num_threads(before)
    assert ident != main and count == 1  # another thread, with the caller's count
    with pytest.raises(ValueError, match="bad checkpoint"):
        build_off_thread(lambda: (_ for _ in ()).throw(ValueError("bad checkpoint")))
