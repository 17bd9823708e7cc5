"""How a step's examples are cut into micro-batches (per process), shortest first."""

import random

from training.stages.trainer import split_by_length


def test_each_micro_batch_holds_examples_of_similar_length() -> None:
    values = [40, 60, 500, 700] * 4
    random.Random(0).shuffle(values)
    lengths = dict(enumerate(values))
    groups = split_by_length(list(range(16)), lengths.__getitem__, micro_batch=2, world=2)
    assert len(groups) == 4 and all(len(g) == 2 and all(len(b) == 2 for b in g) for g in groups)
    flat = [i for group in groups for batch in group for i in batch]
    assert sorted(flat) == list(range(16))  # the same examples, each once
    widths = [lengths[i] for i in flat]
    assert widths == sorted(widths)
    padded = sum(2 * max(lengths[i] for i in batch) for group in groups for batch in group)
    assert padded == sum(lengths.values())  # four lengths, four examples each: no padding


def test_ties_keep_the_step_order() -> None:
    groups = split_by_length([5, 3, 9, 1], lambda i: 10, micro_batch=2, world=1)
    assert groups == [[[5, 3]], [[9, 1]]]
