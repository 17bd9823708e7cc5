"""Chunked prefill bounds decode latency: a long prompt that arrives while streams decode
takes what their decodes leave of each step's token budget, one chunk a step, so every
running stream still gets its token every step."""

import math

import pytest

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import load_checkpoint
from serving.sampling.params import SamplingParams
from tests.tiny_models import TINY_MOE, prompts, save_tiny_moe

BUDGET = 32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


def test_a_long_prompt_never_stalls_running_streams(ckpt):
    engine = LLMEngine(
        load_checkpoint(ckpt), EngineConfig(max_num_batched_tokens=BUDGET), eos_token_ids=[]
    )
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    streams = [f"stream-{i}" for i in range(3)]
    for rid, prompt in zip(streams, prompts(3, TINY_MOE["vocab_size"]), strict=True):
        engine.add_request(rid, prompt[:8], params)
    for _ in range(3):  # prefilled, decoding
        engine.step()
    long_prompt = prompts(1, TINY_MOE["vocab_size"], seed=5)[0] * 5  # > 150 tokens
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=4, temperature=0.0))
    long_seq = engine.requests["long"].seqs[0]
    chunk = BUDGET - len(streams)
    steps = 0
    while not long_seq.prompt_done:
        before = long_seq.num_computed_tokens
        produced = {out.request_id for out in engine.step()}
        steps += 1
        assert set(streams) <= produced  # every stream got a token this step
        assert long_seq.num_computed_tokens - before <= chunk
    assert steps == math.ceil(len(long_prompt) / chunk)
