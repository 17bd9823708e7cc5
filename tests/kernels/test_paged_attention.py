"""The paged decode-attention kernels, Triton's and the CPU's C++ op, against SDPA on the
gathered cache: GQA groups of 1-8 heads (also not a power of two), head dims with and without
padding (and the C++ op's compile-time and run-time head dims), block sizes, and context
lengths of one token, at and across block boundaries, and odd, with block tables in random
order whose padding holds blocks of other sequences."""

import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_attention, cpu_extension, triton_attention
from serving.model.attention import decode_attention, length_mask

CUDA = "cuda" if torch.cuda.is_available() else "cpu"
# The C++ op runs on CPU tensors; Triton on CUDA, or under TRITON_INTERPRET=1 on a CPU.
KERNELS = {
    "triton": (triton_attention.paged_decode_attention, CUDA),
    "cpp": (cpu_attention.paged_decode_attention, "cpu"),
}


@pytest.fixture(params=list(KERNELS))
def kernel(request):
    if request.param == "cpp":
        assert cpu_attention.available(), "the C++ op must build wherever the tests run"
    return KERNELS[request.param]


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
    [(4, 2, 64, 16), (8, 1, 32, 16), (6, 2, 48, 8), (4, 4, 64, 4), (2, 1, 128, 16)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_sdpa_on_the_gathered_cache(kernel, heads, kv_heads, head_dim, block_size, dtype):
    paged_decode_attention, device = kernel
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
    args = [t.to(device) for t in (q, k_cache, v_cache, tables, lens)]
    out = paged_decode_attention(*args, scale)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference(q, k_cache, v_cache, tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tol, atol=tol)


def test_padding_past_the_context_is_never_read(kernel):
    """Poisoned (NaN) cache slots past each context length and in padding blocks leave the
    output finite: masked slots are not loaded."""
    paged_decode_attention, device = kernel
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(6, 4, 1, 16, generator=g)
    v_cache = torch.randn(6, 4, 1, 16, generator=g)
    k_cache[1, 2:] = v_cache[1, 2:] = float("nan")  # past context length 6 = block 0 + 2 slots
    k_cache[5] = v_cache[5] = float("nan")  # a padding block
    tables = torch.tensor([[0, 1, 5]])
    q = torch.randn(1, 2, 16, generator=g)
    args = [t.to(device) for t in (q, k_cache, v_cache, tables, torch.tensor([6]))]
    out = paged_decode_attention(*args, 0.25).cpu()
    assert torch.isfinite(out).all()
    expected = reference(q, k_cache, v_cache, tables, torch.tensor([6]), 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bad_layouts_are_refused():
    q = torch.zeros(1, 3, 16)
    cache = torch.zeros(2, 4, 2, 16)
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    triton_op = triton_attention.paged_decode_attention
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        triton_op(q, cache, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="one layout"):
        triton_op(q[:, :2], cache, cache.transpose(0, 1), tables, lens, 1.0)


def test_the_cpp_op_refuses_what_it_cannot_read():
    """Clear errors, never a read past the cache: a context longer than its block table, a
    context of nothing, a block past the cache, heads that do not group, caches that differ,
    an unsupported dtype."""
    assert cpu_attention.available()
    op = cpu_attention.paged_decode_attention
    q = torch.zeros(1, 4, 16)
    cache = torch.zeros(2, 4, 2, 16)
    tables = torch.zeros(1, 1, dtype=torch.long)
    for lens in (torch.tensor([5]), torch.tensor([0])):
        with pytest.raises(RuntimeError, match="not in \\[1, 4\\]"):
            op(q, cache, cache, tables, lens, 1.0)
    lens = torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="block 2 of sequence 0 is not in the cache's 2"):
        op(q, cache, cache, torch.full((1, 1), 2), lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        op(q[:, :3], cache, cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="must match"):
        op(q, cache, cache.half(), tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        op(q, cache.double(), cache.double(), tables, lens, 1.0)


def test_the_sdpa_path_where_the_op_cannot_be_built(monkeypatch):
    """Where the C++ op does not build, decode attention gathers the blocks for SDPA: the
    same output as the op's."""
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache = torch.randn(2, 12, 4, 2, 32, generator=g)
    tables = torch.tensor([[3, 1, 0], [5, 2, 0], [7, 0, 0]])
    lens = torch.tensor([9, 6, 3])
    q = torch.randn(3, 4, 32, generator=g)
    mask = length_mask(lens, tables.shape[1] * 4, q.dtype)
    with_op = decode_attention(q, k_cache, v_cache, tables, lens, mask, 0.2)
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    with_sdpa = decode_attention(q, k_cache, v_cache, tables, lens, mask, 0.2)
    torch.testing.assert_close(with_op, with_sdpa, rtol=1e-5, atol=1e-5)
    expected = reference(q, k_cache, v_cache, tables, lens, 0.2)
    torch.testing.assert_close(with_sdpa, expected, rtol=1e-5, atol=1e-5)


def test_the_cpp_op_runs_on_torchs_threads():
    """The ops' parallel regions run inside libtorch (`torch::stable::parallel_for`): the
    library links no OpenMP runtime of its own, the process maps only torch's, and the op's
    sequences split over threads give what one thread gives, bit for bit."""
    assert cpu_attention.available()
    from torch.utils import cpp_extension

    name = cpu_extension.library_name()
    built = Path(cpp_extension._get_build_directory(name, False))
    dynamic = subprocess.run(
        ["readelf", "-d", str(built / f"{name}.so")], capture_output=True, text=True
    ).stdout
    assert "[libtorch_cpu.so]" in dynamic
    assert "omp" not in dynamic
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert runtimes == {str(Path(torch.__file__).parent / "lib" / "libgomp.so.1")}

    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(2, 64, 16, 2, 64, generator=g)
    tables = torch.randperm(64, generator=g)[:48].view(8, 6)
    lens = torch.tensor([96, 1, 17, 80, 33, 64, 95, 50])
    q = torch.randn(8, 4, 64, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
        torch.set_num_threads(2)
        two = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
