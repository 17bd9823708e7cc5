"""MXFP4 and NVFP4: FP4 E2M1 codes with block scales, quantized and dequantized in PyTorch.

Both quantize a weight `[..., N, K]` along K, the reduction dimension of `x @ W.t()`:

- **MXFP4** (OCP Microscaling): blocks of 32, one E8M0 scale per block (a power of two,
  stored as its biased exponent byte, 127 = 2^0, 255 = NaN).
- **NVFP4**: blocks of 16, one FP8 E4M3 scale per block, and one FP32 scale per tensor so the
  block scales use E4M3's range: `w = code * e4m3 / global_scale` with
  `global_scale = 448 * 6 / amax(tensor)`, compressed-tensors' convention.

In memory the tensor scale is held per output row (`row_scale = 1 / global_scale`), so rows of
differently scaled projections concatenate exactly (q/k/v, gate/up fused into one matrix).
K need not be a multiple of the block: the last block is padded with zeros and cropped again.
"""

from dataclasses import dataclass
from typing import Literal

import torch

from kernels.fp4 import E2M1_MAX, byte_pair_table, decode_e2m1, encode_e2m1, pack_fp4, unpack_fp4

FP4Format = Literal["mxfp4", "nvfp4"]
BLOCK_SIZE: dict[str, int] = {"mxfp4": 32, "nvfp4": 16}
E4M3_MAX = 448.0
E8M0_BIAS = 127


@dataclass
class FP4Tensor:
    """A block-scaled FP4 weight of logical shape `[..., N, k]`.

    packed: uint8 `[..., N, Kp/2]` (Kp = k rounded up to the block), two codes per byte;
    scales: uint8 `[..., N, Kp/block]`, E8M0 exponents (MXFP4) or E4M3 bits (NVFP4);
    row_scale: fp32 `[..., N]` (NVFP4 only), the inverse of the tensor's global scale.
    """

    format: FP4Format
    packed: torch.Tensor
    scales: torch.Tensor
    row_scale: torch.Tensor | None
    k: int

    @property
    def block_size(self) -> int:
        return BLOCK_SIZE[self.format]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.k))

    def select(self, experts: torch.Tensor) -> "FP4Tensor":
        """The matrices of `experts` (indices) of a stacked `[E, N, k]` weight."""
        rs = None if self.row_scale is None else self.row_scale.index_select(0, experts)
        packed, scales = self.packed.index_select(0, experts), self.scales.index_select(0, experts)
        return FP4Tensor(self.format, packed, scales, rs, self.k)

    def nbytes(self) -> int:
        extra = 0 if self.row_scale is None else self.row_scale.nbytes
        return self.packed.nbytes + self.scales.nbytes + extra


def _blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    """[..., K] -> [..., ceil(K/block), block], zero padded."""
    pad = -w.shape[-1] % block
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.unflatten(-1, (-1, block))


def _check_finite(w: torch.Tensor) -> None:
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize a tensor holding NaN or infinity")


def _encode_blocks(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of blocks divided by their scale (a zero scale gives zero codes)."""
    scaled = torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks))
    return pack_fp4(encode_e2m1(scaled).flatten(-2))


def quantize_mxfp4(w: torch.Tensor) -> FP4Tensor:
    """MXFP4 with the block scale rounded up, 2^ceil(log2(amax / 6)), so the block's largest
    magnitude lands at most on 6 and is never clipped (the choice of gpt-oss's and
    triton_kernels' quantizers; the OCP floor rule would clip values in (6, 8))."""
    _check_finite(w)
    blocks = _blocks(w.float(), BLOCK_SIZE["mxfp4"])
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # frexp gives amax/6 = m * 2^e with m in [0.5, 1): ceil(log2) is e, or e - 1 when m is 0.5.
    mant, exp = torch.frexp(amax / E2M1_MAX)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -E8M0_BIAS)).clamp(-127, 127)
    scale = torch.ldexp(torch.ones_like(amax), exp)
    packed = _encode_blocks(blocks, torch.where(amax > 0, scale, torch.zeros_like(scale)))
    return FP4Tensor(
        "mxfp4", packed, (exp + E8M0_BIAS).squeeze(-1).to(torch.uint8), None, w.shape[-1]
    )


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """`448 * 6 / amax`: maps the tensor's largest block onto E4M3's range (1 for amax 0)."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.where(amax > 0, E4M3_MAX * E2M1_MAX / amax, torch.ones_like(amax))


def quantize_nvfp4(w: torch.Tensor, amax: torch.Tensor | None = None) -> FP4Tensor:
    """NVFP4. `amax` (broadcastable to `w.shape[:-1]`) sets the tensor scale, by default
    the whole tensor's; pass one per expert, shared by its fused gate and up rows, as
    llm-compressor does so engines that fuse the two projections lose nothing."""
    _check_finite(w)
    w = w.float()
    if amax is None:
        amax = w.abs().amax()
    global_scale = nvfp4_global_scale(amax).expand(w.shape[:-1])
    blocks = _blocks(w, BLOCK_SIZE["nvfp4"])
    gs = global_scale[..., None, None]
    block_scale = (blocks.abs().amax(dim=-1, keepdim=True) / E2M1_MAX * gs).clamp(max=E4M3_MAX)
    e4m3 = block_scale.to(torch.float8_e4m3fn)
    packed = _encode_blocks(blocks, e4m3.float() / gs)
    scales = e4m3.squeeze(-1).view(torch.uint8)
    return FP4Tensor("nvfp4", packed, scales, 1.0 / global_scale, w.shape[-1])


def block_scale_values(scales: torch.Tensor, format: FP4Format) -> torch.Tensor:
    """Block scale bytes as fp32 values (the tensor scale not applied)."""
    if format == "mxfp4":
        # E8M0: 2^(byte - 127); 255 is NaN.
        exp = scales.to(torch.int32) - E8M0_BIAS
        values = torch.ldexp(torch.ones(exp.shape, device=exp.device), exp)
        return torch.where(scales == 255, torch.nan, values)
    return scales.view(torch.float8_e4m3fn).float()


_SCALED_PAIRS: dict[tuple[str, torch.device], torch.Tensor] = {}


def scaled_pair_table(format: FP4Format, device: torch.device) -> torch.Tensor:
    """int64 `[256 * 256]`: entry `scale_byte * 256 + packed_byte` holds, as the bits of two
    fp32, the byte's two values times the block scale. Products of an E2M1 value and an
    E8M0 or E4M3 scale are exact in fp32, so one gather of 8-byte words per packed byte
    dequantizes exactly (512 KiB, cached in L2)."""
    key = (format, device)
    if key not in _SCALED_PAIRS:
        scales = block_scale_values(torch.arange(256, dtype=torch.uint8), format)
        pairs = (scales[:, None, None] * byte_pair_table()[None]).reshape(-1, 2)
        _SCALED_PAIRS[key] = pairs.view(torch.int64).flatten().to(device)
    return _SCALED_PAIRS[key]


def dequantize_blocks(t: FP4Tensor, lookup: bool = True) -> torch.Tensor:
    """fp32 `[..., N, k]` with the block scales applied but not the row scale.

    `lookup` gathers through `scaled_pair_table`; otherwise nibbles are unpacked, decoded and
    scaled one op at a time (the plain reference, several times slower on a CPU).
    """
    if lookup:
        index = _blocks(t.packed, t.block_size // 2).int() + (t.scales.int() << 8)[..., None]
        words = scaled_pair_table(t.format, t.packed.device).index_select(0, index.flatten())
        w = words.view(torch.float32).view(*t.packed.shape[:-1], -1)
    else:
        values = _blocks(decode_e2m1(unpack_fp4(t.packed)), t.block_size)
        w = (values * block_scale_values(t.scales, t.format)[..., None]).flatten(-2)
    return w[..., : t.k]


def dequantize(
    t: FP4Tensor, dtype: torch.dtype = torch.float32, lookup: bool = True
) -> torch.Tensor:
    """The weight `[..., N, k]`."""
    w = dequantize_blocks(t, lookup)
    if t.row_scale is not None:
        w = w * t.row_scale[..., None]
    return w.to(dtype)
