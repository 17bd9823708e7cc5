"""The experts of a compiled decode step (`gathered_experts`) against the grouped experts that
every other step runs."""

import pytest
import torch

from serving.model.moe import gathered_experts, grouped_experts, route


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_gathered_experts_match_the_grouped_experts(dtype: torch.dtype, tokens: int):
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 8, 64, 48, 2
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, True)
    expected = grouped_experts(x, weights, ids, gate_up, down)
    got = gathered_experts(x, weights, ids, gate_up, down)
    assert got.dtype == dtype and got.shape == x.shape
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), expected.float(), **tol)
    # Compiled, as a decode graph runs it: the same numbers.
    compiled = torch.compile(gathered_experts, dynamic=False, fullgraph=True)
    torch.testing.assert_close(compiled(x, weights, ids, gate_up, down).float(), got.float(), **tol)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tokens", [2, 24, 64, 300])
def test_grouped_experts_match_each_token_alone(threads: int, tokens: int):
    """Both of the grouped experts' forms, the batched product over padded slices (small
    batches; on two threads, up to a few hundred tokens) and one product per expert, against
    each token running its experts alone."""
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 8, 64, 48, 2
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    down = torch.randn(experts, hidden, inter, generator=g) * 0.2
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, True)
    expected = torch.cat(
        [
            grouped_experts(x[t : t + 1], weights[t : t + 1], ids[t : t + 1], gate_up, down)
            for t in range(tokens)
        ]
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = grouped_experts(x, weights, ids, gate_up, down)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
