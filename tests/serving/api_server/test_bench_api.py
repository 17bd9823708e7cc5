"""The API benchmark's bookkeeping: the offline reference runs as the server runs its engine,
and a row is the median of alternating rounds."""

import threading

import pytest

from loadtests.bench_api import REQUESTS_PER_STREAM, median_row, run_offline
from serving.engine.outputs import SequenceOutput


class _Engine:
    """Records which thread generates; answers each prompt with `new` tokens."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def generate(self, prompts, params):
        self.threads.append(threading.current_thread())
        return [[SequenceOutput(0, token_ids=[1] * params.max_tokens)] for _ in prompts]


def test_offline_steps_on_a_thread_of_its_own_and_counts_every_token():
    engine = _Engine()
    tps = run_offline(engine, [[1, 2], [3]], new=5)  # type: ignore[arg-type]
    assert len(engine.threads) == REQUESTS_PER_STREAM
    assert all(t is not threading.main_thread() for t in engine.threads)
    assert tps > 0


def test_row_is_the_median_of_the_rounds_with_the_ratios_range():
    apis = [
        dict(tps=100.0, ttft=0.05, itl_p50=0.01, itl_p99=0.02),
        dict(tps=90.0, ttft=0.07, itl_p50=0.02, itl_p99=0.04),
        dict(tps=120.0, ttft=0.06, itl_p50=0.03, itl_p99=0.03),
    ]
    row = median_row(4, apis, [100.0, 200.0, 120.0])
    assert row["concurrency"] == 4
    assert row["tps"] == 100.0 and row["offline"] == 120.0
    assert row["ratio"] == pytest.approx(100 / 120)
    assert row["ttft"] == 0.06 and row["itl_p50"] == 0.02 and row["itl_p99"] == 0.03
    assert row["ratios"] == pytest.approx([1.0, 0.45, 1.0])
