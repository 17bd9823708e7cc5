"""The C++ FP4 ops (`kernels/cpu_fp4.py`) against the PyTorch reference (`kernels/reference.py`),
MXFP4 and NVFP4, at every CPU capability this machine has (AVX512, AVX2, ATen's portable
DEFAULT: each a build of its own, run in a process of its own).

The ops decode the exact dequantized weights and multiply fp32 activations, or bf16 ones
(as bf16 pairs where the CPU has them, the weights decoded to bf16, exactly), so they differ
from the reference's fp32 products only in the order of the sums: a few ulps (2^-24) of the
partial sums, which are at the scale of the largest outputs, hence `assert_matches`'s
tolerance of 1e-5 of the output's largest magnitude (and of each element).
"""

from pathlib import Path

import pytest
import torch

from kernels import cpu_fp4, reference
from kernels.formats import FP4Tensor, quantize_mxfp4, quantize_nvfp4
from tests.kernels.cpu_ops import (
    CAPABILITIES,
    assert_built,
    assert_experts_match,
    assert_matches,
    bf16_pairs,
    routing,
    run_at_capability,
)

QUANTIZE = {"mxfp4": quantize_mxfp4, "nvfp4": quantize_nvfp4}
# Capabilities ordered by what they need; a CPU runs its own and every one below it.


@pytest.fixture(autouse=True, scope="module")
def built():
    assert_built(cpu_fp4.available, "FP4")


def fp4(fmt: str, shape: tuple[int, ...], seed: int, per_row: bool = False) -> FP4Tensor:
    """Random weights; `per_row` gives NVFP4 a tensor scale per row (fused projections)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.2
    w[..., :3, :] *= 30  # rows of another magnitude: block and tensor scales that differ
    if fmt == "nvfp4" and per_row:
        return quantize_nvfp4(w, w.abs().amax(-1))
    return QUANTIZE[fmt](w)


ACTIVATIONS = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize(
    ("n", "k"), [(1, 32), (33, 64), (130, 96), (40, 256), (24, 70), (9, 48), (5, 16)]
)
def test_linear_matches_the_reference_for_1_to_32_rows(activation, fmt, n, k):
    """K = 70 is not whole blocks: the op reads the zero-padded last block. K = 48 and 16 are
    an odd number of NVFP4 blocks: bf16 pairs, 32 codes a step, read the last block apart."""
    w = fp4(fmt, (n, k), seed=n + k, per_row=n > 1)
    rows = range(1, 33) if (n, k) == (33, 64) else [1, 2, 3, 7, 8, 9, 16, 31, 32, 70]
    for m in rows:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(activation)
        got = torch.ops.tierserve_fp4.linear(
            cpu_fp4.padded(x, w), w.block_size, w.packed, w.scales, w.row_scale
        )
        assert_matches(got, reference.fp4_linear(x.float(), w))


def test_linear_keeps_leading_dimensions_and_the_activations_dtype():
    w = fp4("nvfp4", (24, 64), seed=0)
    x = torch.randn(2, 3, 64)
    assert_matches(cpu_fp4.fp4_linear(x, w), reference.fp4_linear(x, w))
    got = cpu_fp4.fp4_linear(x.bfloat16(), w)  # summed in fp32, rounded to bf16 once
    expected = reference.fp4_linear(x.bfloat16().float(), w).bfloat16()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize(
    ("experts", "hidden", "inter", "top_k"),
    [(8, 64, 96, 2), (16, 256, 384, 2), (4, 32, 32, 1), (8, 64, 64, 4)],
)
def test_experts_match_the_reference_with_top_k_routing(
    activation, fmt, experts, hidden, inter, top_k
):
    """Token counts of a decode step (1-32) and of a prefill chunk; some experts unused."""
    gate_up = fp4(fmt, (experts, 2 * inter, hidden), seed=1, per_row=True)
    down = fp4(fmt, (experts, hidden, inter), seed=2, per_row=True)
    for tokens in (1, 2, 3, 4, 5, 8, 16, 17, 31, 32, 100):
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
        x = x.to(activation)
        weights, ids = routing(tokens, experts, top_k, seed=tokens)
        got = torch.ops.tierserve_fp4.moe(
            x,
            weights,
            ids,
            gate_up.block_size,
            *(gate_up.packed, gate_up.scales, gate_up.row_scale),
            *(down.packed, down.scales, down.row_scale),
        )
        expected = reference.fp4_moe(x.float(), weights, ids, gate_up, down)
        assert_experts_match(got, expected, rounded=bf16_pairs(x, gate_up.packed))


def test_experts_with_every_token_on_one_expert():
    """One expert with all 40 slots (tiles of 8 and a remainder of 5), the others idle."""
    gate_up, down = fp4("mxfp4", (4, 128, 64), seed=3), fp4("mxfp4", (4, 64, 64), seed=4)
    x = torch.randn(20, 64)
    ids = torch.tensor([[2, 1]] * 20)
    weights = torch.rand(20, 2)
    got = cpu_fp4.fp4_moe(x, weights, ids, gate_up, down)
    assert_matches(got, reference.fp4_moe(x, weights, ids, gate_up, down))


def test_nan_scales_give_nan_as_the_reference_does():
    """An E8M0 scale of 255 is NaN: the rows reading it are NaN, the others are not."""
    w = fp4("mxfp4", (4, 64), seed=5)
    w.scales[1, 0] = 255
    y = cpu_fp4.fp4_linear(torch.randn(2, 64), w)
    assert y[:, 1].isnan().all() and not y[:, [0, 2, 3]].isnan().any()


def test_the_ops_refuse_what_they_cannot_read():
    gate_up, down = fp4("nvfp4", (4, 64, 32), seed=6), fp4("nvfp4", (4, 32, 32), seed=7)
    x = torch.randn(3, 32)
    weights, ids = routing(3, 4, 2, seed=0)
    moe = torch.ops.tierserve_fp4.moe
    args = (16, gate_up.packed, gate_up.scales, gate_up.row_scale)
    rest = (down.packed, down.scales, down.row_scale)
    with pytest.raises(RuntimeError, match="expert 4 is not in the layer's 4"):
        moe(x, weights, torch.full_like(ids, 4), *args, *rest)
    with pytest.raises(RuntimeError, match="do not match packed codes"):
        moe(
            x,
            weights,
            ids,
            16,
            gate_up.packed,
            gate_up.scales[..., :1].contiguous(),
            *args[3:],
            *rest,
        )
    with pytest.raises(RuntimeError, match="not the experts of one layer"):
        moe(x, weights, ids, *args, gate_up.packed, gate_up.scales, gate_up.row_scale)
    with pytest.raises(RuntimeError, match="x has 48 columns"):
        moe(torch.randn(3, 48), weights, ids, *args, *rest)
    with pytest.raises(RuntimeError, match=r"block must be 32 \(MXFP4\) or 16 \(NVFP4\), not 8"):
        moe(x, weights, ids, 8, *args[1:], *rest)
    w = fp4("mxfp4", (8, 64), seed=8)
    with pytest.raises(RuntimeError, match="uint8"):
        torch.ops.tierserve_fp4.linear(x, 32, w.packed.float(), w.scales, None)
    with pytest.raises(RuntimeError, match="row scales"):
        torch.ops.tierserve_fp4.linear(torch.randn(1, 64), 32, w.packed, w.scales, x)


def test_threads_split_the_rows_without_changing_a_bit():
    gate_up, down = fp4("mxfp4", (16, 768, 256), seed=9), fp4("mxfp4", (16, 256, 384), seed=10)
    x = torch.randn(32, 256)
    weights, ids = routing(32, 16, 2, seed=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_fp4.fp4_moe(x, weights, ids, gate_up, down)
        torch.set_num_threads(2)
        two = cpu_fp4.fp4_moe(x, weights, ids, gate_up, down)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_a_compiled_graph_calls_the_ops():
    """The fake kernels let `torch.compile(fullgraph=True)` put the ops in a graph."""
    gate_up, down = fp4("nvfp4", (8, 128, 64), seed=11), fp4("nvfp4", (8, 64, 64), seed=12)
    proj = fp4("nvfp4", (64, 64), seed=13)

    def step(x, weights, ids):
        return cpu_fp4.fp4_linear(cpu_fp4.fp4_moe(x, weights, ids, gate_up, down), proj)

    x = torch.randn(4, 64)
    weights, ids = routing(4, 8, 2, seed=2)
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    assert_matches(compiled(x, weights, ids), step(x, weights, ids))


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_every_capability_of_this_cpu_builds_and_matches(capability):
    run_at_capability(Path(__file__), capability)
