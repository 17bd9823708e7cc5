"""Compiled decode steps (`serving/model/graphs/decode.py`): the same greedy tokens as eager
steps, padding rows that leave every sequence's cache alone, the compile cache on disk, and
whole graphs stored there that a restart loads without tracing (`precompiled.py`).

One tiny model and one padded batch size keep the compilation short (tens of seconds cold)."""

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from kernels.modules import QuantizedWeight
from serving.engine import llm_engine
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import load_checkpoint, quantize_checkpoint, save_checkpoint
from serving.model.graphs.decode import graph_sizes
from serving.model.spans import TokenSpan
from serving.sampling.params import SamplingParams
from speculative.config import SpeculativeConfig
from tests.tiny_models import TINY_MOE, prompts, save_tiny_moe


def test_graph_sizes_cover_max_num_seqs():
    assert graph_sizes(1) == [1]
    assert graph_sizes(3) == [1, 2, 4]
    assert graph_sizes(32) == [1, 2, 4, 8]  # larger steps run in chunks of 8
    assert graph_sizes(64) == [1, 2, 4, 8]


def test_a_speculating_engine_has_a_graph_of_one_verify_step():
    assert graph_sizes(32, 5) == [1, 2, 4, 5, 8]  # k = 4: not padded to 8
    assert graph_sizes(1, 5) == [1, 5]
    assert graph_sizes(4, 4) == [1, 2, 4]  # already a size
    assert graph_sizes(8, 17) == [1, 2, 4, 8, 17]
    assert graph_sizes(8, 33) == [1, 2, 4, 8]  # past the chunked steps: in chunks of 8


@pytest.mark.slow
@pytest.mark.parametrize("fp4", [False, True], ids=["plain-experts", "fp4-experts"])
def test_compiled_decode_gives_the_eager_tokens(tmp_path: Path, monkeypatch, fp4: bool):
    """FP4 experts (kept FP4 on the CPU) are an opaque op in the graph, as plain ones are."""
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "not-this-one"))
    monkeypatch.setattr(llm_engine, "graph_sizes", lambda n, verify_rows: [4])  # one graph
    ckpt = save_tiny_moe(tmp_path / "tiny-moe")
    if fp4:
        quantize_checkpoint(ckpt, tmp_path / "tiny-moe-nvfp4", "nvfp4", False)
        ckpt = tmp_path / "tiny-moe-nvfp4"
    # Different lengths, so decode batches of 3, 2 and 1 are padded to 4; a 16-token budget
    # chunks the prompts, so mixed steps (eager) come between decode-only steps (compiled).
    ps = prompts(3, TINY_MOE["vocab_size"], seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (30, 20, 10)]
    config = dict(max_num_seqs=4, max_num_batched_tokens=16)
    eager = LLMEngine(load_checkpoint(ckpt, keep_fp4=fp4), EngineConfig(**config), eos_token_ids=[])
    compiled = LLMEngine(
        load_checkpoint(ckpt, keep_fp4=fp4),
        EngineConfig(**config, enforce_eager=False),
        eos_token_ids=[],
    )
    assert any(isinstance(m, QuantizedWeight) for m in compiled.model.modules()) == fp4
    graphs = compiled.runner.paged.graphs
    # Warming while the graph compiles (seconds at least: its thread first imports dynamo).
    assert compiled.warmup() == (0, 1, False, False)
    graphs.wait()
    assert graphs.ready_sizes == (4,)
    assert compiled.warmup() == (1, 1, True, True)
    assert eager.warmup().done  # nothing to compile
    compiled_frames = counters["frames"]["total"]
    sizes = []
    run = graphs.run_rows
    graphs.run_rows = lambda ids, *a: (sizes.append(len(ids)), run(ids, *a))[1]
    want = [o[0].token_ids for o in eager.generate(ps, params)]
    got = [o[0].token_ids for o in compiled.generate(ps, params)]
    assert got == want
    assert {1, 2, 3} <= set(sizes)  # every batch size went through the padded graph
    assert counters["frames"]["total"] == compiled_frames  # the engine used the thread's graph
    # Padding rows wrote only to the scratch block past the sequences' blocks.
    n = eager.blocks.num_blocks
    for a, b in zip(eager.model.layers, compiled.model.layers, strict=True):
        torch.testing.assert_close(b.self_attn.k_cache[:n], a.self_attn.k_cache)
        torch.testing.assert_close(b.self_attn.v_cache[:n], a.self_attn.v_cache)
    assert any((tmp_path / "cache" / "inductor").iterdir())
    # A restart loads the whole graph from disk (`precompiled`): nothing is traced again.
    [stored] = (tmp_path / "cache" / "graphs").iterdir()
    frames = counters["frames"]["total"]
    restarted = LLMEngine(
        load_checkpoint(ckpt, keep_fp4=fp4),
        EngineConfig(**config, enforce_eager=False),
        eos_token_ids=[],
    )
    restarted.runner.paged.graphs.wait()
    assert restarted.warmup() == (1, 1, True, True)
    assert counters["frames"]["total"] == frames
    assert [o[0].token_ids for o in restarted.generate(ps, params)] == want
    assert [p.name for p in (tmp_path / "cache" / "graphs").iterdir()] == [stored.name]


@pytest.mark.slow
def test_verify_steps_run_in_the_graph_one_row_per_token(tmp_path: Path, monkeypatch):
    """A sequence's last token and its drafts go through the compiled graph as rows of one
    block table; the rows see each other causally, so speculation keeps eager's tokens."""
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(llm_engine, "graph_sizes", lambda n, verify_rows: [2, 8])
    ckpt = save_tiny_moe(tmp_path / "tiny-moe")
    # Prompts that repeat themselves, so prompt lookup drafts from the first step on.
    ps = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    config = dict(max_num_seqs=2, max_num_batched_tokens=64)
    spec = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=None
    )
    eager = LLMEngine(load_checkpoint(ckpt), EngineConfig(**config), eos_token_ids=[])
    compiled = LLMEngine(
        load_checkpoint(ckpt),
        EngineConfig(**config, enforce_eager=False, speculative=spec),
        eos_token_ids=[],
    )
    graphs = compiled.runner.paged.graphs
    graphs.wait()
    steps = []  # (rows, sequences) of each graphed step
    run = graphs.run_rows

    def recorded(ids: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        steps.append((len(ids), len({tuple(t) for t in tables})))
        return run(ids, positions, tables)

    graphs.run_rows = recorded
    want = [o[0].token_ids for o in eager.generate(ps, params)]
    got = [o[0].token_ids for o in compiled.generate(ps, params)]
    assert got == want
    assert any(rows > seqs for rows, seqs in steps)  # a sequence's token and its drafts
    assert compiled.speculator.stats.num_draft_tokens > 0
    # As while size 8 still compiles: steps of more rows run in chunks of 2, in order.
    graphs.ready_sizes = (2,)
    padded = []
    call = graphs._call
    graphs._call = lambda inputs: (padded.append(len(inputs.ids)), call(inputs))[1]
    steps.clear()
    assert [o[0].token_ids for o in compiled.generate(ps, params)] == want
    assert max(rows for rows, _ in steps) > 2 and set(padded) == {2}


@pytest.mark.slow
def test_bf16_graphs_match_eager_steps(tmp_path: Path, monkeypatch, any_dtype_native):
    """Half-precision graphs freeze the weights into inductor's C++ GEMMs and compute the
    experts in the graph (`gathered_experts`): a decode step's hidden states and the keys it
    writes match an eager step's to bf16's precision (greedy tokens may part on near ties, so
    the step is compared, not the tokens)."""
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(llm_engine, "graph_sizes", lambda n, verify_rows: [4])
    ckpt = save_tiny_moe(tmp_path / "tiny-moe")
    engine = LLMEngine(
        load_checkpoint(ckpt, torch.bfloat16),
        EngineConfig(max_num_seqs=4, enforce_eager=False),
        eos_token_ids=[],
    )
    graphs = engine.runner.paged.graphs
    graphs.wait()
    assert graphs.ready_sizes == (4,)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts(3, TINY_MOE["vocab_size"], seed=5)):
        engine.add_request(f"r{i}", p, params)
    engine.step()  # the prefills (eager)
    seqs = list(engine.scheduler.running)
    assert len(seqs) == 3 and all(s.num_output_tokens == 1 for s in seqs)
    spans = [TokenSpan(s.block_table, len(s) - 1, [s.token_ids[-1]]) for s in seqs]
    ids, positions, meta = engine.runner.paged.prepare(spans)
    layers = engine.model.layers
    with torch.inference_mode():
        eager = engine.model(ids, positions, meta)
        eager_keys = [layer.self_attn.k_cache.clone() for layer in layers]
        compiled = graphs.run(spans)
    assert compiled.dtype == torch.bfloat16
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=3e-2, atol=3e-2)
    for layer, keys in zip(layers, eager_keys, strict=True):
        torch.testing.assert_close(layer.self_attn.k_cache, keys, rtol=3e-2, atol=3e-2)


@pytest.mark.slow
def test_bf16_weights_held_narrow_compute_what_fp32_weights_do(tmp_path: Path, monkeypatch):
    """`auto` on a CPU without native bf16: a bf16 checkpoint's decoder weights stay bf16 (half
    the memory) and widen as they are used. Widening is exact, so eager logits equal those of
    the model widened at load, bit for bit, and compiled steps give its greedy tokens."""
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(llm_engine, "graph_sizes", lambda n, verify_rows: [4])
    monkeypatch.setattr(
        "serving.model.dtype.is_supported", lambda dtype, device=None: dtype == torch.float32
    )
    ckpt = tmp_path / "tiny-moe-bf16"
    save_checkpoint(load_checkpoint(save_tiny_moe(tmp_path / "tiny-moe")).bfloat16(), ckpt)
    narrow, wide = load_checkpoint(ckpt, "auto"), load_checkpoint(ckpt, "float32")
    layer = narrow.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == layer.mlp.gate_up.dtype == torch.bfloat16
    assert narrow.embed_tokens.weight.dtype == layer.input_layernorm.weight.dtype == torch.float32
    assert wide.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    ids = torch.tensor(prompts(2, TINY_MOE["vocab_size"], seed=4)[0][:12])[None]
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        assert torch.equal(narrow(ids, positions), wide(ids, positions))
    ps = prompts(3, TINY_MOE["vocab_size"], seed=5)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    config = dict(max_num_seqs=4, max_num_batched_tokens=16)
    eager = LLMEngine(wide, EngineConfig(**config), eos_token_ids=[])
    compiled = LLMEngine(narrow, EngineConfig(**config, enforce_eager=False), eos_token_ids=[])
    compiled.runner.paged.graphs.wait()
    assert compiled.runner.paged.graphs.ready_sizes == (4,)
    want = [o[0].token_ids for o in eager.generate(ps, params)]
    assert [o[0].token_ids for o in compiled.generate(ps, params)] == want
