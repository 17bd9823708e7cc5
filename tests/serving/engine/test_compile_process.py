"""Decode graphs compiled apart (`serving/engine/compile_process.py`): a server's engine is
ready once its one-row graph is in, a process of its own compiles the larger sizes into the
whole-graph store, and the engine loads them without tracing them itself; a process that
stores nothing leaves those steps in chunks of the one-row graph, with the same tokens."""

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch._dynamo.utils import counters

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import load_checkpoint
from serving.sampling.params import SamplingParams
from tests.tiny_models import TINY_MOE, prompts, save_tiny_moe

# max_num_seqs 2: graphs of 1 and 2 rows (`graph_sizes`).
CONFIG = dict(max_num_seqs=2, max_num_batched_tokens=64)
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def eager_tokens(ckpt: Path, ps: list[list[int]]) -> list[list[int]]:
    eager = LLMEngine(load_checkpoint(ckpt), EngineConfig(**CONFIG), eos_token_ids=[])
    return [o[0].token_ids for o in eager.generate(ps, PARAMS)]


@pytest.mark.slow
def test_larger_graphs_compile_in_a_process_of_their_own(
    tmp_path: Path, monkeypatch, tiny_tokenizer
):
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = save_tiny_moe(tmp_path / "tiny-moe")
    tiny_tokenizer.save(str(ckpt / "tokenizer.json"))  # `from_checkpoint` loads one
    (ckpt / "tokenizer_config.json").write_text("{}")
    engine = LLMEngine.from_checkpoint(
        ckpt, EngineConfig(**CONFIG, enforce_eager=False, compile_graphs_apart=True)
    )
    engine.eos_token_ids = set()
    deadline = time.monotonic() + 300
    while not engine.warmup().ready and time.monotonic() < deadline:
        time.sleep(0.05)
    # Ready at one row, while the other process still imports torch and compiles.
    assert engine.warmup() == (1, 2, True, False)
    frames = counters["frames"]["total"]
    graphs = engine.runner.paged.graphs
    graphs.wait()
    assert engine.warmup() == (2, 2, True, True)
    assert graphs.ready_sizes == (1, 2)
    assert counters["frames"]["total"] == frames  # loaded whole: nothing traced here
    assert len(list((tmp_path / "cache" / "graphs").iterdir())) == 2
    ps = prompts(2, TINY_MOE["vocab_size"], seed=7)
    rows = []
    call = graphs._call
    graphs._call = lambda inputs: (rows.append(len(inputs.ids)), call(inputs))[1]
    assert [o[0].token_ids for o in engine.generate(ps, PARAMS)] == eager_tokens(ckpt, ps)
    assert 2 in rows  # both sequences' decode steps went through the loaded graph


@pytest.mark.slow
def test_a_compile_process_that_stores_nothing_leaves_steps_in_chunks(
    tmp_path: Path, monkeypatch, caplog
):
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = save_tiny_moe(tmp_path / "tiny-moe")
    engine = LLMEngine(
        load_checkpoint(ckpt),
        EngineConfig(**CONFIG, enforce_eager=False),
        eos_token_ids=[],
        compile_apart=lambda: subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]),
    )
    graphs = engine.runner.paged.graphs
    with caplog.at_level(logging.WARNING, logger="serving.model.decode_graphs"):
        graphs.wait()
    assert "no decode graph of 2 rows was stored (compile process exit status 3)" in caplog.text
    assert engine.warmup() == (1, 2, True, True)
    rows = []
    call = graphs._call
    graphs._call = lambda inputs: (rows.append(len(inputs.ids)), call(inputs))[1]
    ps = prompts(2, TINY_MOE["vocab_size"], seed=7)
    assert [o[0].token_ids for o in engine.generate(ps, PARAMS)] == eager_tokens(ckpt, ps)
    assert set(rows) == {1}
