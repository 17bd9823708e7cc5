"""FP4 E2M1: the 4-bit float of MXFP4 and NVFP4, and its packing two codes per byte.

A code is `s e1 e0 m`: sign, a 2-bit exponent (bias 1) and one mantissa bit, so the
magnitudes are 0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6. There is no infinity and no NaN.
Packing puts the even element in the low nibble and the odd element in the high nibble,
the convention of transformers, vLLM and the OCP MX specification's reference code.
"""

import torch

E2M1_MAX = 6.0

# The value of each code 0..15; codes 8..15 are the negatives (8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)

# Midpoints between neighbouring magnitudes. A tie goes to the code with an even mantissa
# bit: upwards at 0.75, 1.75, 3.5 (to 1, 2, 4), downwards at 0.25, 1.25, 2.5, 5.
_ROUND_DOWN_AT_TIE = (0.25, 1.25, 2.5, 5.0)
_ROUND_UP_AT_TIE = (0.75, 1.75, 3.5)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0..15) of `x` rounded to nearest, ties to even, saturating at +-6.

    Infinities saturate like any other out-of-range value. NaN has no E2M1 code and raises:
    the quantizers refuse non-finite weights before they get here.
    """
    if torch.isnan(x).any():
        raise ValueError("E2M1 has no NaN: cannot encode NaN")
    a = x.abs().float()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t in _ROUND_DOWN_AT_TIE:
        code += (a > t).to(torch.uint8)
    for t in _ROUND_UP_AT_TIE:
        code += (a >= t).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of E2M1 codes (any integer dtype, low 4 bits used)."""
    table = E2M1_TABLE.to(device=codes.device, dtype=dtype)
    return table[(codes & 0xF).long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes (K even) -> [..., K/2] bytes, element 2j low nibble, 2j+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got {codes.shape[-1]}")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes, the inverse of `pack_fp4`."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def byte_pair_table(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[256, 2]: the two values a packed byte holds (low nibble first).

    Dequantizing through this table is one gather per byte instead of unpacking nibbles and
    gathering twice: the lookup-table path of the CPU reference.
    """
    b = torch.arange(256, dtype=torch.uint8)
    return decode_e2m1(unpack_fp4(b.unsqueeze(-1)), dtype)
