"""Data builders: deterministic, streaming, verified, and never from held-out seeds."""

import itertools

import pytest

from tasks import get_domain
from tasks.base import Verdict
from tasks.seeds import eval_seed
from training.data.streams import pretrain_documents, sft_examples, tasks


@pytest.mark.parametrize("name", ["math", "code", "terminal", "tools"])
def test_sft_examples_are_deterministic_verified_conversations(name):
    domain = get_domain(name)
    a = list(sft_examples(domain, range(3), [1, 2], "think"))
    b = list(sft_examples(domain, range(3), [1, 2], "think"))
    assert a == b and len(a) == 6
    for example in a:
        roles = [m["role"] for m in example["messages"]]
        assert roles[0] in ("system", "user") and "assistant" in roles
    short = next(sft_examples(domain, [0], [1], "short"))
    assert "<think>" not in str(short["messages"][-1].get("content"))


def test_builders_stream_and_refuse_held_out_seeds():
    domain = get_domain("math")
    endless = pretrain_documents(domain, itertools.count(), [1, 2, 3], "short")
    docs = list(itertools.islice(endless, 5))
    assert len(docs) == 5 and all(docs)
    with pytest.raises(ValueError, match="held out"):
        next(tasks(domain, [eval_seed(0, 0)], [1]))


class _FlakyVerdicts:
    """A domain whose episodes fail their first `failures` verdicts (a sandbox timeout)."""

    def __init__(self, failures: int) -> None:
        self.inner, self.failures = get_domain("math"), failures

    def generate(self, seed, difficulty):
        return self.inner.generate(seed, difficulty)

    def reference(self, task, style):
        return self.inner.reference(task, style)

    def start(self, task):
        episode = self.inner.start(task)
        verdict = episode.verdict
        fail = self.failures > 0
        self.failures -= 1
        episode.verdict = lambda: Verdict(0.0, "timeout") if fail else verdict()
        return episode


def test_a_reference_that_fails_once_is_replayed_and_twice_raises():
    (example,) = sft_examples(_FlakyVerdicts(1), [0], [1], "think")
    assert example["messages"][-1]["role"] == "assistant"
    with pytest.raises(RuntimeError, match="reference: timeout"):
        next(sft_examples(_FlakyVerdicts(2), [0], [1], "think"))
