"""Sampler: greedy, filters, seeded and statistical sampling, penalties, min_tokens, logprobs."""

import math

import pytest
import torch

from serving.sampling.filters import apply_penalties
from serving.sampling.params import SamplingParams, SamplingRow
from serving.sampling.sampler import Sampler

V = 32


def row(output: list[int] | None = None, prompt: list[int] | None = None, **kw) -> SamplingRow:
    params = SamplingParams(**kw)
    generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, prompt or [], output or [], generator)


def random_logits(batch: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_all_greedy_is_one_argmax():
    logits = random_logits(8)
    result = Sampler(V, [0])(logits, [row(temperature=0) for _ in range(8)])
    assert result.token_ids == logits.argmax(-1).tolist()
    assert result.logprobs == [None] * 8


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = random_logits(6)
    rows = [row(temperature=(i + 1) % 2, logprobs=2, presence_penalty=0.1) for i in range(6)]
    before = logits.clone()
    tokens = Sampler(V, [0])(logits, rows).token_ids
    assert tokens[1::2] == logits.argmax(-1)[1::2].tolist()
    assert torch.equal(logits, before)  # the caller's logits are left alone


def test_padded_vocab_columns_are_never_sampled():
    logits = torch.zeros(2, V + 8)
    logits[:, V:] = 100.0
    tokens = Sampler(V, [0])(logits, [row(temperature=0), row(temperature=1.0)]).token_ids
    assert all(t < V for t in tokens)


@pytest.mark.parametrize("kw", [{"top_p": 0.95}, {"top_k": 5}])
def test_seeded_rows_are_reproducible_whatever_the_batch(kw):
    def run(seed: int, others: list[SamplingRow]) -> list[int]:
        sampler, seeded = Sampler(V, [0]), row(seed=seed, temperature=1.0, **kw)
        rows, tokens = [*others[:1], seeded, *others[1:]], []
        for step in range(20):
            seeds = [step if r is seeded else 1000 * (j + 1) + step for j, r in enumerate(rows)]
            logits = torch.cat([random_logits(1, seed=s) for s in seeds])
            tokens.append(sampler(logits, rows).token_ids[rows.index(seeded)])
            seeded.output_token_ids.append(tokens[-1])
        return tokens

    alone = run(1234, [])
    assert alone == run(1234, [])
    assert alone != run(4321, [])
    # full-vocabulary path, and cut to the top 20 columns
    assert alone == run(1234, [row(temperature=0.7), row(seed=99), row(temperature=0, top_k=3)])
    assert alone == run(1234, [row(top_k=20), row(seed=99, top_k=2), row(temperature=0)])


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 5, "top_p": 1e-6}])
def test_degenerate_filters_equal_greedy(kw):
    logits = random_logits(64)
    tokens = Sampler(V, [0])(logits, [row(temperature=1.5, **kw) for _ in range(64)]).token_ids
    assert tokens == logits.argmax(-1).tolist()


def sampled_support(probs: list[float], n: int = 4000, **kw) -> set[int]:
    torch.manual_seed(0)
    logits = torch.tensor(probs).log().repeat(n, 1)
    return set(Sampler(len(probs), [])(logits, [row(**kw) for _ in range(n)]).token_ids)


def test_top_k_keeps_exactly_k_tokens():
    assert sampled_support([0.1, 0.3, 0.05, 0.25, 0.2, 0.1], top_k=3) == {1, 3, 4}


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert sampled_support([0.15, 0.5, 0.05, 0.3], top_p=0.7) == {1, 3}
    assert sampled_support([0.15, 0.5, 0.05, 0.3], top_p=0.85) == {0, 1, 3}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    # threshold 0.3 * 0.4 = 0.12
    assert sampled_support([0.4, 0.3, 0.15, 0.1, 0.05], min_p=0.3) == {0, 1, 2}


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("top_k", [0, 8, 5])
def test_sampling_matches_the_softmax(temperature, seeded, top_k):
    torch.manual_seed(0)
    n, logits = 8000, torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2])
    rows = [row(temperature=temperature, top_k=top_k, seed=i if seeded else None) for i in range(n)]
    tokens = Sampler(8, [])(logits.repeat(n, 1), rows).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=8).float()
    kept = logits.argsort(descending=True)[: top_k or 8]
    expected = torch.zeros(8)
    expected[kept] = n * torch.softmax(logits[kept] / temperature, dim=0)
    assert counts[expected == 0].sum() == 0
    chi2 = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum().item()
    assert (
        chi2 < 24.3
    )  # above the 99.9% quantile of chi-square with 7 (or fewer) degrees of freedom


def test_penalties_match_a_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]]).repeat(3, 1)
    rows = [
        row([3, 3, 2], [0, 1], repetition_penalty=2, frequency_penalty=0.5, presence_penalty=0.25),
        row([3, 3, 2], [0, 1]),
        row([4, 4], [0], presence_penalty=1.0),
    ]
    apply_penalties(logits, rows)
    # repetition on prompt+output (/2 if > 0, *2 if not), then -0.5*count - 0.25 on output
    assert logits[0].tolist() == [1.0, -2.0, 0.25 - 0.5 - 0.25, 1.5 - 1.0 - 0.25, -2.0, 0.0]
    assert logits[1].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]
    assert logits[2].tolist() == [2.0, -1.0, 0.5, 3.0, -3.0, 0.0]


def test_repetition_penalty_changes_the_greedy_choice():
    logits, sampler = torch.tensor([[3.0, 2.0]]), Sampler(2, [])
    assert sampler(logits, [row([0], temperature=0)]).token_ids == [0]
    assert sampler(logits, [row([0], temperature=0, repetition_penalty=2.0)]).token_ids == [1]


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 7], logits[0, 1] = 10.0, 9.0, 8.0
    sampler = Sampler(V, eos_token_ids=[5])

    def greedy(n_out: int, **kw) -> int:
        rows = [row([9] * n_out, temperature=0, min_tokens=3, stop_token_ids=[7], **kw)]
        return sampler(logits, rows).token_ids[0]

    assert greedy(2) == 1
    assert greedy(2, ignore_eos=True) == 1  # as in vLLM, ignore_eos only means "don't stop"
    assert greedy(3) == 5
    torch.manual_seed(0)
    rows = [row(temperature=1.0, min_tokens=1, stop_token_ids=[7]) for _ in range(500)]
    assert not {5, 7} & set(sampler(logits.repeat(500, 1), rows).token_ids)


def test_logprobs_are_the_raw_log_softmax_with_sorted_top_k():
    logits = random_logits(4)
    rows = [
        row(temperature=0.5, repetition_penalty=1.5, logprobs=5, prompt=[1, 2]),
        row(temperature=0, logprobs=0),
        row(temperature=1.0),
        row(temperature=0, logprobs=3, top_k=2),
    ]
    result = Sampler(V, [0])(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    for i, k in enumerate([5, 0, None, 3]):
        lp = result.logprobs[i]
        if k is None:
            assert lp is None
            continue
        assert lp.token_id == result.token_ids[i]
        assert math.isclose(lp.logprob, expected[i, result.token_ids[i]].item(), abs_tol=1e-5)
        if k == 0:
            assert lp.top is None
            continue
        top = lp.top
        assert [t for t, _ in top] == expected[i].topk(k).indices.tolist()
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert all(math.isclose(lp, expected[i, t].item(), abs_tol=1e-5) for t, lp in top)
