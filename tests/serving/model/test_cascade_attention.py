"""Cascade attention for decodes that share their first cache blocks
(`SharedPrefixes` in serving/model/attention.py): which decodes group, the same attention as
reading every sequence's whole cache, and the engine's samples unchanged by it."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model import paged
from serving.model.attention import AttentionMetadata, SharedPrefixes, paged_attention
from serving.model.checkpoint import load_checkpoint
from serving.model.paged import shared_prefix_groups
from serving.model.sampling import SamplingParams
from tests.tiny_models import TINY_MOE, prompts, save_tiny_moe


def test_groups_are_the_deepest_shared_prefixes():
    bs = 4
    tables = [
        [0, 1, 2, 10],  # prompt A's samples: the template block 0, then A's blocks 1-2
        [0, 1, 2, 11],
        [0, 1, 2, 12, 13],
        [0, 5, 20],  # prompt B's samples share 0 and 5
        [0, 5, 21],
        [0, 6, 22],  # alone past the template block: in no group
        [7, 23],  # alone
        [8, 24],  # [8] is shared with the next decode, but is the block this one writes in
        [8],
    ]
    lens = [14, 13, 18, 10, 9, 12, 5, 6, 3]
    groups = shared_prefix_groups(tables, lens, bs)
    assert sorted(groups) == [([0, 1, 2], 3), ([3, 4], 2)]


def test_a_group_stops_before_the_block_a_decode_writes_in():
    # Decode 1's token is at position 8, in block 2 of its table: only blocks 0-1 are shared.
    groups = shared_prefix_groups([[0, 1, 2, 3], [0, 1, 2]], [16, 9], 4)
    assert groups == [([0, 1], 2)]


def reference(q, k_cache, v_cache, tables, lens, scale):
    out = []
    for b, n in enumerate(lens):
        k = k_cache[tables[b]].flatten(0, 1)[:n].transpose(0, 1).float()
        v = v_cache[tables[b]].flatten(0, 1)[:n].transpose(0, 1).float()
        o = F.scaled_dot_product_attention(
            q[b][:, None].float(), k, v, scale=scale, enable_gqa=True
        )
        out.append(o[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_matches_attention_over_each_whole_cache(dtype):
    g = torch.Generator().manual_seed(0)
    bs, kv_heads, heads, d = 4, 2, 4, 16
    k_cache = torch.randn(64, bs, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(64, bs, kv_heads, d, generator=g).to(dtype)
    tables = [
        [0, 1, 2, 10],
        [0, 1, 2, 11, 12],
        [0, 1, 2, 13],
        [3, 4, 14],
        [3, 4, 15],
        [5, 16, 17],  # in no group
    ]
    lens = [13, 20, 16, 9, 12, 10]
    q = torch.randn(len(tables), heads, d, generator=g).to(dtype)
    groups = shared_prefix_groups(tables, lens, bs)
    assert len(groups) == 2
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(tables), dtype=torch.long),
        num_decodes=len(tables),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_context_lens=torch.tensor(lens),
        shared=SharedPrefixes.build(groups, tables, lens, bs, dtype, torch.device("cpu")),
    )
    meta.prepare(bs, dtype, torch.device("cpu"))
    out = paged_attention(q, k_cache, v_cache, meta, d**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    expected = reference(q, k_cache, v_cache, tables, lens, d**-0.5)
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def test_samples_of_one_prompt_are_unchanged_by_cascade(tmp_path: Path, monkeypatch):
    """n = 4 samples of each of two prompts, seeded: the same tokens with and without cascade
    attention, which did run."""
    ckpt = save_tiny_moe(tmp_path / "tiny-moe")
    ps = [p * 3 for p in prompts(2, TINY_MOE["vocab_size"], seed=5)]  # several full blocks
    params = SamplingParams(n=4, max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    config = EngineConfig(max_num_seqs=8, block_size=4)

    def run() -> list[list[list[int]]]:
        engine = LLMEngine(load_checkpoint(ckpt), config, eos_token_ids=[])
        return [[s.token_ids for s in o] for o in engine.generate(ps, [params, params])]

    calls = []
    attend = SharedPrefixes.attend
    monkeypatch.setattr(SharedPrefixes, "attend", lambda *a: (calls.append(1), attend(*a))[1])
    with_cascade = run()
    assert calls
    monkeypatch.setattr(paged, "shared_prefix_groups", lambda *a: [])
    assert run() == with_cascade
