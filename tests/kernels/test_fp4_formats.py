"""FP4 E2M1, nibble packing, MXFP4 and NVFP4 against their definitions and against
transformers' and torchao's implementations on the same bytes."""

import pytest
import torch

from kernels.formats import (
    block_scale_values,
    dequantize,
    quantize_mxfp4,
    quantize_nvfp4,
)
from kernels.fp4 import (
    E2M1_VALUES,
    byte_pair_table,
    decode_e2m1,
    encode_e2m1,
    pack_fp4,
    unpack_fp4,
)

QUANTIZERS = {"mxfp4": quantize_mxfp4, "nvfp4": quantize_nvfp4}


def test_all_16_codes_decode_to_the_e2m1_values_and_encode_back():
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode_e2m1(codes)
    expected = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    assert torch.equal(values, expected)
    assert torch.equal(torch.signbit(values), codes >= 8)  # code 8 is -0.0
    assert torch.equal(encode_e2m1(values), codes)


def test_ties_round_to_the_even_mantissa():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert decode_e2m1(encode_e2m1(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert decode_e2m1(encode_e2m1(-ties)).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    just_above = ties + 1e-3
    assert decode_e2m1(encode_e2m1(just_above)).tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_encode_is_round_to_nearest_on_a_dense_grid():
    x = torch.linspace(-7, 7, 10001)
    got = decode_e2m1(encode_e2m1(x))
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    nearest_error = (x[:, None] - grid[None]).abs().min(dim=1).values
    assert torch.all((got - x.clamp(-6, 6)).abs() <= nearest_error + 1e-6)


def test_saturation_and_non_finite_input():
    big = torch.tensor([6.5, 7.0, 1e30, float("inf"), -float("inf"), -8.0])
    assert decode_e2m1(encode_e2m1(big)).tolist() == [6.0, 6.0, 6.0, 6.0, -6.0, -6.0]
    with pytest.raises(ValueError, match="NaN"):
        encode_e2m1(torch.tensor([1.0, float("nan")]))
    for quantize in QUANTIZERS.values():
        for bad in (float("nan"), float("inf")):
            w = torch.ones(2, 32)
            w[1, 3] = bad
            with pytest.raises(ValueError, match="NaN or infinity"):
                quantize(w)


def test_packing_puts_the_even_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_fp4(codes).tolist() == [[0x21, 0x0F]]
    every = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_fp4(pack_fp4(every)), every)
    table = byte_pair_table()
    assert torch.equal(
        table, decode_e2m1(unpack_fp4(torch.arange(256, dtype=torch.uint8)[:, None]))
    )
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


def test_mxfp4_representable_values_round_trip_exactly():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (6, 128), generator=g)
    codes[:, ::32] = 7  # every block holds a 6, so its scale is exactly its power of two
    scale = 2.0 ** torch.randint(-8, 4, (6, 4, 1), generator=g).float()
    w = (decode_e2m1(codes).view(6, 4, 32) * scale).flatten(1)
    assert torch.equal(dequantize(quantize_mxfp4(w)), w)


def test_nvfp4_quantizing_a_dequantized_tensor_gives_the_same_bytes():
    """NVFP4 values carry a non-power-of-two tensor scale, so the round trip is on bytes."""
    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(0))
    t = quantize_nvfp4(w)
    again = quantize_nvfp4(dequantize(t))
    assert torch.equal(again.packed, t.packed)
    assert torch.equal(again.scales, t.scales)


def test_mxfp4_scale_is_the_smallest_power_of_two_that_fits_the_block():
    w = torch.zeros(1, 96)
    w[0, :32] = 6.0  # fits scale 1 exactly
    w[0, 32:64] = 6.01  # needs the next power of two
    w[0, 64] = 0.75 * 2**-3
    t = quantize_mxfp4(w)
    assert block_scale_values(t.scales, "mxfp4").tolist() == [[1.0, 2.0, 2**-6]]
    assert dequantize(t)[0, 32].item() == 6.0  # 6.01 / 2 = 3.005 -> 3 -> 6
    assert dequantize(t)[0, 64].item() == 0.75 * 2**-3


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_all_zero_blocks(fmt):
    w = torch.zeros(3, 64)
    w[1, 40] = 0.375
    t = QUANTIZERS[fmt](w)
    assert torch.equal(dequantize(t)[[0, 2]], torch.zeros(2, 64))
    assert dequantize(t)[1, 40].item() == pytest.approx(0.375)
    assert torch.equal(dequantize(QUANTIZERS[fmt](torch.zeros(2, 48))), torch.zeros(2, 48))
    if fmt == "mxfp4":
        assert t.scales[0].tolist() == [0, 0]  # 2^-127: the smallest E8M0 scale


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (2, 5, 70), (7, 33)])
def test_odd_shapes_are_padded_and_cropped_and_errors_stay_within_half_a_step(fmt, shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    t = QUANTIZERS[fmt](w)
    block = t.block_size
    padded = -(-shape[-1] // block) * block
    assert t.packed.shape == (*shape[:-1], padded // 2)
    assert t.scales.shape == (*shape[:-1], padded // block)
    got = dequantize(t)
    assert got.shape == w.shape
    # The widest E2M1 step is 2 (from 4 to 6): no element is off by more than 1 * its scale.
    scale = block_scale_values(t.scales, fmt).repeat_interleave(block, -1)[..., : shape[-1]]
    if t.row_scale is not None:
        scale = scale * t.row_scale[..., None]
    assert torch.all((got - w).abs() <= scale * (1 + 1e-6))
    assert torch.equal(dequantize(t, lookup=False), got)


def test_nvfp4_tensor_scale_uses_the_e4m3_range_and_can_be_shared():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    t = quantize_nvfp4(w)
    assert torch.allclose(1 / t.row_scale, 448 * 6 / w.abs().max())
    assert block_scale_values(t.scales, "nvfp4").max().item() == 448.0
    shared = quantize_nvfp4(w[:2], amax=w.abs().max())
    assert torch.equal(dequantize(shared), dequantize(t)[:2])


def test_mxfp4_bytes_dequantize_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(3))
    t = quantize_mxfp4(w)
    # gpt-oss layout: blocks [E, N, K/32, 16], scales [E, N, K/32]; returns [E, K, N].
    theirs = convert_moe_packed_tensors(t.packed.view(3, 40, 3, 16), t.scales, dtype=torch.float32)
    assert torch.equal(theirs.transpose(1, 2), dequantize(t))


def test_e2m1_and_nvfp4_agree_with_torchao():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    x = torch.cat([torch.linspace(-8, 8, 2001), torch.tensor([0.25, 0.75, 1.25, 2.5, 5.0])])
    assert torch.equal(encode_e2m1(x), f32_to_f4_unpacked(x))
    w = torch.randn(24, 80, generator=torch.Generator().manual_seed(4))
    t = quantize_nvfp4(w)
    assert torch.equal(unpack_uint4(t.packed), unpack_fp4(t.packed))
    theirs = NVFP4Tensor(
        t.packed,
        t.scales.view(torch.float8_e4m3fn),
        16,
        torch.float32,
        per_tensor_scale=t.row_scale[0],
    )
    # Same values up to the order of the two scale multiplies (one rounding).
    torch.testing.assert_close(theirs.dequantize(torch.float32), dequantize(t), rtol=2e-7, atol=0)
