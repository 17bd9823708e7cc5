"""The C++ dense ops (`kernels/cpu_dense.py`) against PyTorch's fp32 products, fp32 and bf16
weights, at every CPU capability this machine has (each a build of its own, run in a process
of its own).

A bf16 weight is widened exactly, so the ops differ from the fp32 product of the widened
weight only in the order of the sums: `assert_matches`'s tolerance of 1e-5 of the output's
largest magnitude (and of each element), as the FP4 ops' tests.
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_dense, cpu_extension
from serving.model.moe import grouped_experts
from tests.kernels.cpu_ops import (
    CAPABILITIES,
    assert_built,
    assert_experts_match,
    assert_matches,
    bf16_pairs,
    routing,
    run_at_capability,
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, scope="module")
def built():
    assert_built(cpu_dense.available, "dense")


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("activation", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(1, 8), (33, 64), (130, 96), (7, 70), (5, 3), (512, 256)])
def test_linear_matches_the_product_for_1_to_32_rows(activation, dtype, n, k):
    """K = 70 and 3 are not whole vectors: the op reads the tail of each row apart. bf16
    activations (bf16 pairs against bf16 weights where the CPU has them) give exact products
    too, so the op's fp32 output matches as closely."""
    w = randn(n, k, seed=n + k, dtype=dtype)
    rows = range(1, 33) if (n, k) == (33, 64) else [1, 2, 3, 5, 7, 8, 9, 16, 31, 32, 70]
    for m in rows:
        x = randn(m, k, seed=m, dtype=activation)
        got = torch.ops.tierserve_dense.linear(x, w)
        assert_matches(got, F.linear(x.float(), w.float()))


def test_linear_keeps_leading_dimensions():
    w = randn(24, 64, seed=0, dtype=torch.bfloat16)
    x = randn(2, 3, 64, seed=1)
    assert_matches(cpu_dense.dense_linear(x, w), F.linear(x, w.float()))


def test_the_ops_run_for_more_than_one_row_of_what_they_read():
    w = randn(8, 64, seed=0)
    assert cpu_dense.runs(randn(2, 64, seed=1), w, w.bfloat16())
    assert not cpu_dense.runs(randn(1, 64, seed=1), w)  # one row: the fused reduction
    head = randn(cpu_dense.WIDE_WEIGHT_ROWS, 64, seed=2)
    assert cpu_dense.runs(randn(1, 64, seed=1), head.bfloat16())  # but a bf16 LM head: the op
    experts = randn(4, 16, 64, seed=3).bfloat16()
    assert cpu_dense.runs(randn(1, 64, seed=1).bfloat16(), experts)  # and bf16 rows' experts
    assert not cpu_dense.runs(randn(1, 64, seed=1), experts)
    assert not cpu_dense.runs(randn(1, 64, seed=1), head)
    assert not cpu_dense.runs(randn(1, 64, seed=1), head[:-1].bfloat16())
    # Half-precision activations go to the op too; one row of them against any bf16
    # weight is the op too (the fused reduction is slower there).
    assert cpu_dense.runs(randn(2, 64, seed=1).bfloat16(), w)
    assert cpu_dense.runs(randn(1, 64, seed=1).bfloat16(), w.bfloat16())
    assert not cpu_dense.runs(randn(1, 64, seed=1).bfloat16(), w)
    assert not cpu_dense.runs(randn(2, 64, seed=1).to(torch.int32), w)
    assert not cpu_dense.runs(randn(2, 64, seed=1), w.half())
    assert not cpu_dense.runs(randn(2, 8, seed=1), w.t())


@pytest.mark.parametrize("activation", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("experts", "hidden", "inter", "top_k"),
    [(8, 64, 96, 2), (16, 256, 384, 2), (4, 32, 32, 1), (8, 64, 64, 4), (6, 36, 20, 2)],
)
def test_experts_match_the_grouped_experts(activation, dtype, experts, hidden, inter, top_k):
    """Token counts of a decode step (1-32) and of a prefill chunk; some experts unused."""
    gate_up = randn(experts, 2 * inter, hidden, seed=1, dtype=dtype) * 0.2
    down = randn(experts, hidden, inter, seed=2, dtype=dtype) * 0.2
    for tokens in (1, 2, 3, 4, 5, 8, 16, 17, 31, 32, 100):
        x = randn(tokens, hidden, seed=tokens, dtype=activation)
        weights, ids = routing(tokens, experts, top_k, seed=tokens)
        got = torch.ops.tierserve_dense.moe(x, weights, ids, gate_up, down)
        expected = grouped_experts(x.float(), weights, ids, gate_up.float(), down.float())
        assert_experts_match(got, expected, rounded=bf16_pairs(x, gate_up))


def test_half_precision_activations_are_computed_in_fp32_and_rounded_once():
    """A bf16 graph's product: the activations' exact products summed in fp32, in bf16, as a
    bf16 matmul accumulating in fp32 gives it (one rounding, so at most one bf16 step apart);
    the experts' inner activations are bf16 too where the op multiplies bf16 pairs."""
    w = randn(96, 64, seed=0, dtype=torch.bfloat16)
    gate_up, down = randn(4, 64, 64, seed=1, dtype=torch.bfloat16), randn(4, 64, 32, seed=2)
    down = (down * 0.2).bfloat16()
    weights, ids = routing(5, 4, 2, seed=3)
    for x in (randn(1, 64, seed=4, dtype=torch.bfloat16), randn(5, 64, seed=5).half()):
        y = cpu_dense.dense_linear(x, w)
        assert y.dtype == x.dtype
        torch.testing.assert_close(y, F.linear(x.float(), w.float()).to(x.dtype))
        x = x.expand(5, 64).contiguous()
        y = cpu_dense.dense_moe(x, weights, ids, gate_up, down)
        expected = grouped_experts(x.float(), weights, ids, gate_up.float(), down.float())
        assert y.dtype == x.dtype
        if bf16_pairs(x, gate_up):  # within bf16 roundings of inner values and outputs
            assert_experts_match(y.float(), expected, rounded=True)
        else:
            torch.testing.assert_close(y, expected.to(x.dtype))


def test_experts_with_every_token_on_one_expert():
    """One expert with all 40 slots (tiles of 8 and a remainder of 5), the others idle."""
    gate_up, down = randn(4, 128, 64, seed=3), randn(4, 64, 64, seed=4)
    x = randn(20, 64, seed=5)
    ids = torch.tensor([[2, 1]] * 20)
    weights = torch.rand(20, 2)
    got = cpu_dense.dense_moe(x, weights, ids, gate_up, down)
    assert_matches(got, grouped_experts(x, weights, ids, gate_up, down))


def test_the_ops_refuse_what_they_cannot_read():
    gate_up, down = randn(4, 64, 32, seed=6), randn(4, 32, 32, seed=7)
    x = randn(3, 32, seed=8)
    weights, ids = routing(3, 4, 2, seed=0)
    moe = torch.ops.tierserve_dense.moe
    with pytest.raises(RuntimeError, match="expert 4 is not in the layer's 4"):
        moe(x, weights, torch.full_like(ids, 4), gate_up, down)
    with pytest.raises(RuntimeError, match="not the experts of one layer"):
        moe(x, weights, ids, gate_up, gate_up)
    with pytest.raises(RuntimeError, match="x has 48 columns"):
        moe(randn(3, 48, seed=9), weights, ids, gate_up, down)
    with pytest.raises(RuntimeError, match="down must be BFloat16"):
        moe(x, weights, ids, gate_up.bfloat16(), down)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.tierserve_dense.linear(x, down.half()[0])
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.tierserve_dense.linear(x, down[0].t())
    with pytest.raises(RuntimeError, match=r"x must be contiguous float32 or bfloat16 \[rows"):
        torch.ops.tierserve_dense.linear(x.half(), down[0])


@pytest.mark.parametrize("activation", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_bits_whatever_rows_are_beside_it(activation, dtype):
    """A batch gives each sequence what it gets alone: every tile of rows and of weight rows
    sums in one order. 37 weight rows end in a partial tile, K = 70 in a partial vector."""
    w = randn(37, 70, seed=3, dtype=dtype)
    x = randn(13, 70, seed=4, dtype=activation)
    batch = cpu_dense.dense_linear(x, w)
    for i in range(13):
        assert torch.equal(cpu_dense.dense_linear(x[i : i + 1], w)[0], batch[i])
        assert torch.equal(cpu_dense.dense_linear(x[i:], w)[0], batch[i])


def test_threads_split_the_rows_without_changing_a_bit():
    gate_up, down = randn(16, 768, 256, seed=9), randn(16, 256, 384, seed=10)
    x = randn(32, 256, seed=11)
    weights, ids = routing(32, 16, 2, seed=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_dense.dense_moe(x, weights, ids, gate_up, down)
        torch.set_num_threads(2)
        two = cpu_dense.dense_moe(x, weights, ids, gate_up, down)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_a_compiled_graph_calls_the_ops():
    """The fake kernels let `torch.compile(fullgraph=True)` put the ops in a graph."""
    gate_up = randn(8, 128, 64, seed=11, dtype=torch.bfloat16)
    down = randn(8, 64, 64, seed=12, dtype=torch.bfloat16)
    proj = randn(48, 64, seed=13)

    def step(x, weights, ids):
        return cpu_dense.dense_linear(cpu_dense.dense_moe(x, weights, ids, gate_up, down), proj)

    x = randn(5, 64, seed=14)
    weights, ids = routing(5, 8, 2, seed=2)
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    assert_matches(compiled(x, weights, ids), step(x, weights, ids))


def test_an_answer_a_trace_asks_for_first_is_refused_by_name():
    """A trace reads `available()` as a constant once it has been answered; asked first by a
    graph being traced, which could neither take its lock nor build the ops, it says so."""

    def decide() -> bool:
        return True

    answer = cpu_extension.once(decide)
    step = torch.compile(lambda x: x + answer(), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"decide\(\) was first called by a graph being traced"):
        step(torch.ones(2))
    assert answer() is True
    assert torch.equal(step(torch.ones(2)), torch.full((2,), 2.0))


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_every_capability_of_this_cpu_builds_and_matches(capability):
    run_at_capability(Path(__file__), capability)
