"""What a compiled decode step writes out instead of calling an op, against what the other
steps run: projections as reductions (`serving/model/linear.py`) and decode attention in the
graph (`graph_decode_attention`, the paged op or written out) over block tables of any width,
with no recompilation; and the eager LM head's oneDNN layout against the plain product."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from kernels import cpu_attention, cpu_dense
from serving.model.attention import (
    AttentionMetadata,
    decode_attention,
    graph_decode_attention,
    length_mask,
    write_kv,
)
from serving.model.causal_lm import CausalLM, pack_for_inference
from serving.model.config import ModelConfig
from serving.model.dtype import is_supported
from serving.model.linear import Linear, pack_onednn, reduces
from tests.tiny_models import TINY_MOE


@pytest.mark.parametrize("rows", [1, 5, 32, 33])
def test_compiled_projection_is_the_linear(rows: int):
    """Up to the largest graph's 32 rows a compiled projection is a reduction; past them (and
    eager) the product."""
    g = torch.Generator().manual_seed(rows)
    layer = Linear(48, 80, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 48, generator=g))
        layer.bias.copy_(torch.randn(80, generator=g))
    x = torch.randn(rows, 48, generator=g)
    traced: list[bool] = []
    cpu_dense.available()  # decided before a trace reads it, as `DecodeGraphs` does

    def project(x: torch.Tensor) -> torch.Tensor:
        traced.append(reduces(x))
        return layer(x)

    with torch.inference_mode():
        got = torch.compile(project, dynamic=False, fullgraph=True)(x)
    assert traced == [rows <= 32]
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    with torch.inference_mode():
        assert not reduces(x)  # eager


@pytest.mark.parametrize("rows", [1, 4, 16, 300])
def test_onednn_projection_is_the_linear(rows: int):
    """An fp32 projection packed for oneDNN gives the product, eagerly; traced for a decode
    graph it is still the reduction over the plain weight. bf16 is packed only where the CPU
    computes it natively, and then gives bf16's product; fp16 is not."""
    assert torch.backends.mkldnn.is_available()  # every x86 CPU build of torch has it
    g = torch.Generator().manual_seed(rows)
    layer = Linear(48, 80, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 48, generator=g))
        layer.bias.copy_(torch.randn(80, generator=g))
    pack_onednn(layer)
    assert layer.onednn_weight is not None and layer.onednn_weight.is_mkldnn
    x = torch.randn(rows, 48, generator=g)
    want = F.linear(x, layer.weight, layer.bias)
    cpu_dense.available()  # decided before a trace reads it, as `DecodeGraphs` does
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
        if rows <= 32:
            compiled = torch.compile(layer, dynamic=False, fullgraph=True)
            torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-4)
    half = Linear(48, 80, bias=True).to(torch.bfloat16)
    pack_onednn(half)
    assert (half.onednn_weight is not None) == is_supported(torch.bfloat16)
    with torch.inference_mode():
        x = x.bfloat16()
        torch.testing.assert_close(half(x), F.linear(x, half.weight, half.bias))
    fp16 = Linear(48, 80, bias=False).to(torch.float16)
    pack_onednn(fp16)
    assert fp16.onednn_weight is None


def test_one_row_of_a_onednn_packed_projection_is_the_dense_op(monkeypatch):
    """A lone stream's logits: one row through the dense op over the plain weight, several
    rows through oneDNN's copy; both the product."""
    g = torch.Generator().manual_seed(0)
    layer = Linear(48, 80, bias=True)
    pack_onednn(layer)
    rows_in_op: list[int] = []
    op = cpu_dense.dense_linear
    monkeypatch.setattr(
        cpu_dense, "dense_linear", lambda x, w: rows_in_op.append(len(x)) or op(x, w)
    )
    with torch.inference_mode():
        for rows in (1, 4):
            x = torch.randn(rows, 48, generator=g)
            want = F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
    assert rows_in_op == [1]


def test_inference_packing_gives_the_lm_head_onednn_layout():
    """`pack_for_inference` packs the (tied) fp32 head for oneDNN and leaves the embedding
    it shares as it was; the logits stay the plain product's."""
    config = ModelConfig.from_dict(
        {**TINY_MOE, "architectures": ["Qwen3MoeForCausalLM"], "tie_word_embeddings": True}
    )
    model = CausalLM(config)
    model.init_weights()
    model.eval()
    hidden = torch.randn(5, config.hidden_size)
    with torch.inference_mode():
        want = model.compute_logits(hidden)
        embed = model.embed_tokens.weight
        pack_for_inference(model)
        assert model.lm_head.onednn_weight is not None
        assert model.embed_tokens.weight is embed
        torch.testing.assert_close(model.compute_logits(hidden), want, rtol=1e-5, atol=1e-4)


def _cache(blocks: int, block_size: int, kv_heads: int, d: int, g: torch.Generator):
    return (
        torch.randn(blocks, block_size, kv_heads, d, generator=g),
        torch.randn(blocks, block_size, kv_heads, d, generator=g),
    )


@pytest.mark.parametrize("paged_kernel", [True, False], ids=["paged-op", "written-out"])
def test_graph_attention_matches_sdpa_at_every_context_without_recompiling(
    paged_kernel: bool, monkeypatch
):
    """One compiled function, called with contexts of 2 to 9 blocks (the width dynamic), gives
    what SDPA on the gathered cache gives, and writes the step's keys and values where it does:
    with the paged decode op in the graph, and written out where that op cannot be built."""
    assert cpu_attention.available()
    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, d, bs, num_blocks = 3, 4, 2, 16, 4, 40
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:12] for _ in range(b)])
    compiled = torch.compile(graph_decode_attention, dynamic=False, fullgraph=True)
    frames = None
    for lens in ([5, 8, 2], [7, 20, 13], [33, 3, 30], [36, 35, 1]):
        lens = torch.tensor(lens)
        width = max(2, -(-int(lens.max()) // bs))
        slots = tables[torch.arange(b), (lens - 1) // bs] * bs + (lens - 1) % bs
        q = torch.randn(b, heads, d, generator=g)
        k, v = torch.randn(b, kv_heads, d, generator=g), torch.randn(b, kv_heads, d, generator=g)
        k_cache, v_cache = _cache(num_blocks, bs, kv_heads, d, g)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        meta = AttentionMetadata(
            slots,
            b,
            tables[:, :width],
            decode_context_lens=lens,
            in_graph=True,
            paged_kernel=paged_kernel,
        )
        torch._dynamo.mark_dynamic(meta.decode_block_tables, 1)
        with torch.inference_mode():
            got = compiled(q, k, v, k_cache, v_cache, meta, d**-0.5)
            write_kv(k_ref, v_ref, k, v, slots)
            with monkeypatch.context() as sdpa:  # decode attention as SDPA on gathered blocks
                sdpa.setattr(cpu_attention, "available", lambda: False)
                mask = length_mask(lens, tables.shape[1] * bs, torch.float32)
                want = decode_attention(q, k_ref, v_ref, tables, lens, mask, d**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_cache, k_ref)
        torch.testing.assert_close(v_cache, v_ref)
        if frames is None:
            frames = counters["frames"]["total"]
    assert counters["frames"]["total"] == frames  # widths 2-9: the first graph served them all
