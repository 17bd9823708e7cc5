"""The Triton FP4 kernels against the PyTorch reference, on a grid of shapes.

Without a GPU they run under Triton's CPU interpreter (TRITON_INTERPRET=1, set here before
triton is imported), with fp32 activations; on a CUDA machine they run on the device.
"""

import pytest
import torch

pytest.importorskip("triton")

from kernels.formats import quantize_mxfp4, quantize_nvfp4
from kernels.reference import fp4_linear, fp4_moe
from kernels.triton_gemm import w4a16_gemm, w4a16_linear
from kernels.triton_moe import align_by_expert, fused_moe
from serving.model.moe import grouped_experts, route

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUANTIZE = {"mxfp4": quantize_mxfp4, "nvfp4": quantize_nvfp4}
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def tolerance(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


def fp4(fmt: str, shape: tuple[int, ...], seed: int):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.2
    t = QUANTIZE[fmt](w)
    for name in ("packed", "scales", "row_scale"):
        if getattr(t, name) is not None:
            setattr(t, name, getattr(t, name).to(DEVICE))
    return t


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 1, 32), (1, 33, 70), (3, 64, 96), (16, 130, 64), (17, 40, 200), (70, 96, 128)],
)
def test_w4a16_gemm_matches_the_reference(fmt, dtype, m, n, k):
    """M <= 16 runs the decode tiles, larger M the prefill tiles; K = 70 and 200 pad the
    last scale block; N = 1, 33, 130 leave partial tiles."""
    w = fp4(fmt, (n, k), seed=m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(DEVICE, dtype)
    got = w4a16_gemm(x, w)
    assert got.dtype == dtype and got.shape == (m, n)
    expected = fp4_linear(x.float(), w)
    torch.testing.assert_close(got.float(), expected, **tolerance(dtype))


def test_w4a16_linear_keeps_leading_dimensions_and_checks_shapes():
    w = fp4("nvfp4", (24, 64), seed=0)
    x = torch.randn(2, 3, 64, device=DEVICE)
    torch.testing.assert_close(w4a16_linear(x, w), fp4_linear(x, w), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="does not match"):
        w4a16_gemm(torch.randn(2, 48, device=DEVICE), w)


def test_align_by_expert_groups_slots_in_padded_blocks_of_one_expert():
    topk_ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [5, 3]])
    slots, block_expert = align_by_expert(topk_ids, num_experts=8, block_m=4)
    sentinel = topk_ids.numel()
    real = slots[slots != sentinel]
    assert sorted(real.tolist()) == list(range(sentinel))  # every slot exactly once
    blocks = slots.view(-1, 4)
    for b, expert in enumerate(block_expert.tolist()):
        ids = [topk_ids.flatten()[s].item() for s in blocks[b].tolist() if s != sentinel]
        if expert < 0:
            assert ids == []
        else:
            assert ids and set(ids) == {expert}
    # Experts 0, 1, 2, 3 (5 slots: 2 blocks), 5 are used; 4, 6, 7 are empty.
    assert [e for e in block_expert.tolist() if e >= 0] == [0, 1, 2, 3, 3, 5]


MOE_CASES = {
    "single token, top-1": (1, 4, 64, 32, 1),
    "top-2, empty experts": (3, 8, 64, 32, 2),
    "odd sizes": (7, 8, 70, 48, 2),
    "top-8 of 8, prefill tiles": (40, 8, 64, 96, 8),
}


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_fused_moe_matches_the_reference(fmt, dtype, case):
    tokens, experts, hidden, inter, top_k = MOE_CASES[case]
    gate_up = fp4(fmt, (experts, 2 * inter, hidden), seed=1)
    down = fp4(fmt, (experts, hidden, inter), seed=2)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    weights, ids = route(torch.randn(tokens, experts, generator=g).to(DEVICE), top_k, True)
    got = fused_moe(x, weights, ids, gate_up, down)
    assert got.dtype == dtype and got.shape == x.shape
    expected = fp4_moe(x.float(), weights, ids, gate_up, down)
    torch.testing.assert_close(got.float(), expected, **tolerance(dtype))


def test_fused_moe_with_every_token_on_one_expert():
    gate_up, down = fp4("nvfp4", (6, 64, 32), seed=3), fp4("nvfp4", (6, 32, 32), seed=4)
    x = torch.randn(20, 32, device=DEVICE)
    ids = torch.full((20, 1), 4, device=DEVICE)
    weights = torch.rand(20, 1, device=DEVICE)
    got = fused_moe(x, weights, ids, gate_up, down)
    torch.testing.assert_close(got, fp4_moe(x, weights, ids, gate_up, down), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(MOE_CASES))
@pytest.mark.parametrize("transposed", [False, True])
def test_fused_moe_over_plain_weights_matches_the_grouped_experts(dtype, case, transposed):
    """Plain expert weights (the bf16 path on CUDA), row-major or laid out transposed in
    memory as `pack_for_inference` leaves them."""
    tokens, experts, hidden, inter, top_k = MOE_CASES[case]
    g = torch.Generator().manual_seed(tokens + 1)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    down = torch.randn(experts, hidden, inter, generator=g) * 0.2
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, True)
    expected = grouped_experts(x, weights, ids, gate_up, down)
    if transposed:
        gate_up, down = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (gate_up, down))
    x, weights, ids = (t.to(DEVICE) for t in (x, weights, ids))
    got = fused_moe(x.to(dtype), weights, ids, gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype))
    torch.testing.assert_close(got.float().cpu(), expected, **tolerance(dtype))
