"""Engine behaviour beyond greedy equivalence: n > 1, abort, stops, logprobs, seeds, limits."""

import pytest
import torch

from serving.engine.llm_engine import EngineConfig, EngineInputError, LLMEngine
from serving.model.checkpoint import load_checkpoint
from serving.sampling.params import SamplingParams
from tests.tiny_models import TINY_MOE, prompts, save_tiny_moe

VOCAB = TINY_MOE["vocab_size"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture
def engine(ckpt) -> LLMEngine:
    return LLMEngine(load_checkpoint(ckpt), EngineConfig(block_size=4), eos_token_ids=[7])


def _assert_empty(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.blocks.seq_hashes


def test_n_sequences_share_the_prompt_blocks(engine):
    prompt = prompts(1, VOCAB, seed=3)[0] * 3  # long enough for several full blocks
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    engine.add_request("r", prompt, params)
    seqs = engine.requests["r"].seqs
    while engine.has_unfinished():
        engine.step()
        if all(s.block_table for s in seqs):
            shared = set(seqs[0].block_table[: len(prompt) // 4 - 1])
            assert all(shared <= set(s.block_table) for s in seqs[1:])
    assert all(s.num_cached_tokens >= (len(prompt) - 1) // 4 * 4 for s in seqs[1:])
    assert len({tuple(s.output_token_ids) for s in seqs}) > 1  # seed + i: different samples
    _assert_empty(engine)


def test_abort_frees_everything(engine):
    for i, p in enumerate(prompts(4, VOCAB, seed=4)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.blocks.num_free_blocks < engine.blocks.num_blocks
    for i in range(4):
        assert engine.abort(f"r{i}")
    assert not engine.abort("r0")
    _assert_empty(engine)


def test_finish_reasons(engine):
    p = prompts(1, VOCAB, seed=5)[0]
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = engine.generate([p], greedy)[0][0].token_ids
    stop_at = ref[5]
    first = ref.index(stop_at)
    out = engine.generate(
        [p], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_at])
    )
    assert (out[0][0].finish_reason, out[0][0].stop_reason) == ("stop", stop_at)
    assert out[0][0].token_ids == ref[: first + 1]
    out = engine.generate(
        [p],
        SamplingParams(
            max_tokens=30, temperature=0.0, min_tokens=first + 2, stop_token_ids=[stop_at]
        ),
    )
    assert len(out[0][0].token_ids) > first + 1
    out = engine.generate([p], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    assert (out[0][0].finish_reason, len(out[0][0].token_ids)) == ("length", 9)
    _assert_empty(engine)


def test_eos_stops_unless_ignored(ckpt):
    p = prompts(1, VOCAB, seed=6)[0]
    probe = LLMEngine(load_checkpoint(ckpt), eos_token_ids=[])
    ref = probe.generate([p], SamplingParams(max_tokens=20, temperature=0.0))[0][0].token_ids
    eos = ref[3]
    engine = LLMEngine(load_checkpoint(ckpt), eos_token_ids=[eos])
    out = engine.generate([p], SamplingParams(max_tokens=20, temperature=0.0))[0][0]
    assert out.finish_reason == "stop" and out.token_ids == ref[: ref.index(eos) + 1]
    out = engine.generate([p], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0][
        0
    ]
    assert out.finish_reason == "length" and out.token_ids == ref


def test_logprobs_are_the_model_distribution(engine):
    p = prompts(1, VOCAB, seed=7)[0]
    params = SamplingParams(
        max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    engine.add_request("lp", p, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    logprobs = [lp for o in outs for lp in o.outputs[0].logprobs]
    prompt_lps = outs[0].prompt_logprobs
    model = engine.model
    seq = p + tokens
    with torch.no_grad():
        ref = model.compute_logits(model(torch.tensor([seq]), torch.arange(len(seq))[None]))[
            0
        ].log_softmax(-1)
    assert prompt_lps[0] is None and len(prompt_lps) == len(p)
    for i in range(1, len(p)):
        assert prompt_lps[i].token_id == p[i]
        assert abs(prompt_lps[i].logprob - ref[i - 1, p[i]].item()) < 1e-4
        assert len(prompt_lps[i].top) == 2
    for j, lp in enumerate(logprobs):
        row = ref[len(p) - 1 + j]
        assert lp.token_id == tokens[j] == row.argmax().item()
        assert abs(lp.logprob - row[tokens[j]].item()) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    _assert_empty(engine)


def test_seeded_sampling_ignores_the_rest_of_the_batch(ckpt):
    p = prompts(1, VOCAB, seed=8)[0]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = LLMEngine(load_checkpoint(ckpt), eos_token_ids=[]).generate([p], seeded)
    crowd = prompts(5, VOCAB, seed=9)
    mixed = LLMEngine(load_checkpoint(ckpt), eos_token_ids=[]).generate(
        [*crowd, p], [SamplingParams(max_tokens=16, temperature=1.0)] * 5 + [seeded]
    )
    assert mixed[-1][0].token_ids == alone[0][0].token_ids


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([VOCAB], SamplingParams(), "token ids"),
        ([-1, 3], SamplingParams(), "token ids"),
        ([1, 2], SamplingParams(stop_token_ids=[VOCAB + 5]), "stop_token_ids"),
        ([1] * 500, SamplingParams(max_tokens=100), "maximum context length"),
    ],
)
def test_bad_requests_are_refused(engine, prompt, params, message):
    with pytest.raises(EngineInputError, match=message):
        engine.add_request("bad", prompt, params)
    _assert_empty(engine)


def test_kv_cache_is_sized_from_the_budget(ckpt):
    model = load_checkpoint(ckpt)
    per_block = (
        2 * 2 * 16 * 4 * 16 * TINY_MOE["num_hidden_layers"]
    )  # k+v, kv heads, dim, fp32, tokens
    engine = LLMEngine(model, EngineConfig(kv_cache_bytes=10 * per_block), eos_token_ids=[])
    assert engine.blocks.num_blocks == 10
    assert engine.max_model_len == 160  # the cache holds 160 tokens: the longest request
