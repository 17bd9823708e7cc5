"""Continuous batching changes nothing: batched greedy == alone == transformers."""

import pytest
import torch

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import load_checkpoint
from serving.model.paged import kv_bytes_per_block
from serving.sampling.params import SamplingParams
from tests.tiny_models import TINY_MOE, prompts, save_tiny_moe

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


def _engine(ckpt, **kw) -> LLMEngine:
    return LLMEngine(load_checkpoint(ckpt), EngineConfig(**kw), eos_token_ids=[])


def _tokens(outs):
    return [o[0].token_ids for o in outs]


def test_batched_equals_alone_equals_transformers(ckpt):
    ps = prompts(8, TINY_MOE["vocab_size"])
    batched = _tokens(_engine(ckpt).generate(ps, GREEDY))
    alone = [_tokens(_engine(ckpt).generate([p], GREEDY))[0] for p in ps]
    assert batched == alone
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    for p, got in zip(ps, batched, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)
        ref = ref[0, len(p) :].tolist()  # the checkpoint has no eos: all 40 tokens come
        assert got == ref
    assert len(set(map(tuple, batched))) > 1  # the model does not say the same thing to all


def test_chunked_prefill_and_preemption_keep_outputs(ckpt):
    ps = prompts(8, TINY_MOE["vocab_size"], seed=1)
    ref = _tokens(_engine(ckpt).generate(ps, GREEDY))
    # A 16-token budget forces chunked prefill; a 32-block cache (128 tokens) forces preemption.
    block_bytes = kv_bytes_per_block(load_checkpoint(ckpt).config, 4, torch.float32)
    engine = _engine(ckpt, block_size=4, max_num_batched_tokens=16, kv_cache_bytes=32 * block_bytes)
    preempted = []
    orig = engine.scheduler._preempt
    engine.scheduler._preempt = lambda s: (preempted.append(s.seq_id), orig(s))
    assert _tokens(engine.generate(ps, GREEDY)) == ref
    assert preempted, "the small cache should have forced a preemption"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_prefix_cache_hit_equals_miss(ckpt):
    engine = _engine(ckpt, block_size=4)
    shared = prompts(1, TINY_MOE["vocab_size"], seed=2)[0] * 2
    miss = _tokens(engine.generate([[*shared, 5, 6, 7]], GREEDY))
    hit_out = engine.generate([[*shared, 5, 6, 7]], GREEDY)
    assert _tokens(hit_out) == miss
    cold = _tokens(
        _engine(ckpt, enable_prefix_caching=False).generate([[*shared, 5, 6, 7]], GREEDY)
    )
    assert cold == miss
    engine.add_request("probe", [*shared, 9], GREEDY)
    engine.step()
    seq = engine.requests["probe"].seqs[0]
    assert seq.num_cached_tokens >= len(shared) // 4 * 4 - 4
    engine.abort("probe")
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_bfloat16_matches_transformers_in_bfloat16(ckpt):
    """Greedy tokens as transformers computes them in bf16, and logprobs as far from fp32 as
    transformers' own in bf16.

    The oracle is transformers' bf16 forward over the whole sequence we produced (its cached
    `generate` is not bit-stable against that forward in bf16 either), and its fp32 forward.
    This model's weights are scaled up, so bf16 roundings move its logprobs by up to a few
    nats at a few steps, differently for any two orders of the same sums (transformers in
    bf16 itself, against fp32): exact agreement is required at nearly every step, and our
    logprobs' distance from fp32 must be distributed as transformers' bf16 one is (its
    median and 90th percentile), not step by step.
    """
    ps = prompts(6, TINY_MOE["vocab_size"], seed=3)
    # A torch dtype, not `--dtype bfloat16`: the numerics hold where bf16 is emulated too,
    # and the name is refused on a CPU without native bf16 (`serving/model/dtype.py`).
    engine = LLMEngine(load_checkpoint(ckpt, torch.bfloat16), EngineConfig(), eos_token_ids=[])
    assert engine.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    assert engine.runner.model.layers[0].self_attn.k_cache.dtype == torch.bfloat16
    outs = engine.generate(
        ps, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0)
    )
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    exact, ours_off, theirs_off = [], [], []
    for p, [out] in zip(ps, outs, strict=True):
        ids, got = torch.tensor([p + out.token_ids]), torch.tensor(out.token_ids)
        with torch.no_grad():
            ref = hf16(input_ids=ids).logits.float()[0, len(p) - 1 : -1].log_softmax(-1)
            ref32 = hf32(input_ids=ids).logits[0, len(p) - 1 : -1].log_softmax(-1)
        fp32 = ref32.gather(-1, got[:, None])[:, 0]
        ours = torch.tensor([lp.logprob for lp in out.logprobs])
        ours_off.append((ours - fp32).abs())
        theirs_off.append((ref.gather(-1, got[:, None])[:, 0] - fp32).abs())
        exact += (ref.argmax(-1) == got).tolist()
    assert sum(exact) >= 0.97 * len(exact)
    quantiles = torch.tensor([0.5, 0.9])
    ours_q = torch.cat(ours_off).quantile(quantiles)
    theirs_q = torch.cat(theirs_off).quantile(quantiles)
    assert (ours_q <= 1.5 * theirs_q).all(), (ours_q, theirs_q)
