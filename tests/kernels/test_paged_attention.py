"""The Triton paged decode-attention kernel against SDPA on the gathered cache: GQA groups of
1-8 heads (also not a power of two), head dims with and without padding, block sizes, and
context lengths of one token, at and across block boundaries, and odd, with block tables in
random order whose padding holds blocks of other sequences."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kernels.triton_attention import paged_decode_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Each sequence's keys and values gathered into one tensor, then SDPA."""
    out = []
    for b, length in enumerate(context_lens.tolist()):
        blocks = block_tables[b, : -(-length // k_cache.shape[1])]
        k = k_cache[blocks].flatten(0, 1)[:length].transpose(0, 1)  # [kv, L, d]
        v = v_cache[blocks].flatten(0, 1)[:length].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[b][:, None].float(), k.float(), v.float(), scale=scale, enable_gqa=True
        )
        out.append(o[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(4, 2, 64, 16), (8, 1, 32, 16), (6, 2, 48, 8), (4, 4, 64, 4)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_sdpa_on_the_gathered_cache(heads, kv_heads, head_dim, block_size, dtype):
    g = torch.Generator().manual_seed(heads * 100 + head_dim + block_size)
    lengths = [1, block_size, block_size + 1, 2 * block_size - 1, 37, 3 * block_size]
    max_blocks = max(-(-n // block_size) for n in lengths) + 1  # one block of padding
    num_blocks = len(lengths) * max_blocks + 3
    cache = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(cache, generator=g).to(dtype)
    v_cache = torch.randn(cache, generator=g).to(dtype)
    # Every sequence owns distinct blocks in random order; its padding points at others'.
    order = torch.randperm(num_blocks, generator=g)
    tables = order[: len(lengths) * max_blocks].view(len(lengths), max_blocks)
    q = torch.randn(len(lengths), heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor(lengths)
    scale = head_dim**-0.5
    args = [t.to(DEVICE) for t in (q, k_cache, v_cache, tables, lens)]
    out = paged_decode_attention(*args, scale)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference(q, k_cache, v_cache, tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tol, atol=tol)


def test_padding_past_the_context_is_never_read():
    """Poisoned (NaN) cache slots past each context length and in padding blocks leave the
    output finite: masked slots are not loaded."""
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(6, 4, 1, 16, generator=g)
    v_cache = torch.randn(6, 4, 1, 16, generator=g)
    k_cache[1, 2:] = v_cache[1, 2:] = float("nan")  # past context length 6 = block 0 + 2 slots
    k_cache[5] = v_cache[5] = float("nan")  # a padding block
    tables = torch.tensor([[0, 1, 5]])
    q = torch.randn(1, 2, 16, generator=g)
    args = [t.to(DEVICE) for t in (q, k_cache, v_cache, tables, torch.tensor([6]))]
    out = paged_decode_attention(*args, 0.25).cpu()
    assert torch.isfinite(out).all()
    expected = reference(q, k_cache, v_cache, tables, torch.tensor([6]), 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bad_layouts_are_refused():
    q = torch.zeros(1, 3, 16)
    cache = torch.zeros(2, 4, 2, 16)
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_decode_attention(q, cache, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="one layout"):
        paged_decode_attention(q[:, :2], cache, cache.transpose(0, 1), tables, lens, 1.0)
