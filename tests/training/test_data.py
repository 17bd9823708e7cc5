"""Data builders: deterministic, streaming, verified, and never from held-out seeds."""

import itertools

import pytest

from training.data import pretrain_documents, sft_examples, tasks
from training.tasks import get_domain
from training.tasks.seeds import eval_seed


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
