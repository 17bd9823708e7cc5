"""The asyncio front of the engine: a consumer that falls behind gets its waiting deltas as
one output, in order, with nothing lost."""

import asyncio

import pytest

from serving.engine.async_engine import AsyncEngine
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import load_checkpoint
from serving.sampling.params import SamplingParams
from tests.tiny_models import TINY_MOE, prompts, save_tiny_moe


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


async def test_a_lagging_consumer_gets_merged_deltas(ckpt):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=2)
    prompt = prompts(1, TINY_MOE["vocab_size"])[0]
    engine = LLMEngine(load_checkpoint(ckpt), EngineConfig(), eos_token_ids=[])
    [expected] = engine.generate([prompt], params)
    aengine = AsyncEngine(engine)
    try:
        request = engine.validate(prompt, params)
        outputs = []
        async for out in aengine.generate("lagging", request):
            outputs.append(out)
            if len(outputs) == 1:
                while engine.has_unfinished():  # fall behind: the rest arrives meanwhile
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.05)
    finally:
        aengine.stop()
    assert len(outputs) == 2 and outputs[-1].finished
    merged = outputs[0].merge(outputs[1])
    for seq in expected:
        [got] = [o for o in merged.outputs if o.index == seq.index]
        assert got.token_ids == seq.token_ids and len(got.token_ids) == 24
        assert got.finish_reason == "length"
