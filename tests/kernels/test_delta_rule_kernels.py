"""The Triton gated delta rule (`kernels/triton_delta_rule.py`) against the PyTorch forms of
`serving/model/hybrid/delta_rule.py`: the token-by-token recurrence, and the chunked form whose
chunk-to-chunk recurrence it runs, from a zero state and from a given one, with key and value
dimensions that fill the tiles and ones that do not (padding), several value tiles, and a
sequence shorter than a chunk. Under `TRITON_INTERPRET=1` without a GPU."""

import pytest
import torch

from kernels import ops, triton_delta_rule
from serving.model.hybrid import delta_rule
from serving.model.hybrid.delta_rule import l2_normalize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(b: int, h: int, length: int, dk: int, dv: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(b, h, length, dk, generator=g)) * dk**-0.5
    k = l2_normalize(torch.randn(b, h, length, dk, generator=g))
    v = torch.randn(b, h, length, dv, generator=g)
    decay = -torch.rand(b, h, length, generator=g)  # log space, <= 0
    beta = torch.rand(b, h, length, generator=g)
    state = torch.randn(b, h, dk, dv, generator=g) * 0.1
    return [t.to(DEVICE) for t in (q, k, v, decay, beta, state)]


@pytest.fixture
def triton_side(monkeypatch):
    """The model's delta rule with its sequential parts on the Triton kernels."""
    monkeypatch.setattr(ops, "use_triton", lambda device: True)


SHAPES = [(1, 2, 16, 16), (2, 1, 24, 40), (1, 1, 32, 80)]  # (b, h, dk, dv): 80 is two tiles


@pytest.mark.parametrize(("b", "h", "dk", "dv"), SHAPES)
@pytest.mark.parametrize("start", ["zero", "given"])
def test_recurrent_kernel_matches_pytorch(b, h, dk, dv, start):
    q, k, v, g, beta, state = inputs(b, h, 7, dk, dv, seed=dk + dv)
    state = torch.zeros_like(state) if start == "zero" else state
    expected, expected_state = delta_rule.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    out, new_state = triton_delta_rule.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_state, expected_state, rtol=1e-5, atol=1e-5)
    assert not torch.equal(new_state, state)  # the caller's state is not written in place


@pytest.mark.parametrize(("b", "h", "dk", "dv"), SHAPES)
@pytest.mark.parametrize("length", [5, 16, 45])
def test_chunked_form_on_the_kernel_matches_pytorch(triton_side, b, h, dk, dv, length):
    q, k, v, g, beta, state = inputs(b, h, length, dk, dv, seed=length)
    with pytest.MonkeyPatch.context() as pytorch_side:
        pytorch_side.setattr(ops, "use_triton", lambda device: False)
        expected, expected_state = delta_rule.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    out, new_state = delta_rule.chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(new_state, expected_state, rtol=1e-4, atol=1e-4)


def test_chunk_sizes_the_kernel_cannot_tile_are_refused():
    terms = [torch.zeros(1, 1, 1, 8, 16)] * 3
    with pytest.raises(ValueError, match="power of two of 16 or more"):
        triton_delta_rule.chunk_recurrence(
            terms[0], terms[1], terms[2], torch.zeros(1, 1, 1, 8, 8), terms[0],
            torch.ones(1, 1, 1), torch.zeros(1, 1, 16, 16),
        )  # fmt: skip
