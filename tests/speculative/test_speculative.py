"""Speculative decoding in the engine: greedy outputs identical to plain decoding for every
drafter, exact KV block accounting through rollbacks, and the adaptive lookahead."""

from pathlib import Path

import pytest
import torch

from serving.engine import llm_engine
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.config import ModelConfig
from serving.model.paged import kv_bytes_per_block
from serving.sampling.params import SamplingParams
from speculative.config import SpeculativeConfig
from speculative.speculator import StepCost, best_lookahead
from tests import REPO

MODELS = REPO / "models"
TARGET = MODELS / "demo-highspeed"  # a trained target with an MTP layer
DRAFT = MODELS / "demo-draft"

# Speculating in batches of any size, so the mixed batches below speculate.
SPECS = {
    "ngram": SpeculativeConfig(method="ngram", disable_by_batch_size=None),
    "mtp": SpeculativeConfig(method="mtp", disable_by_batch_size=None),
    "draft": SpeculativeConfig(method="draft", model=DRAFT, disable_by_batch_size=None),
}


def _engine(spec: SpeculativeConfig | None, **kwargs) -> LLMEngine:
    """In fp32: in bf16 a verify step's k + 1 tokens and a decode step's one round
    differently, and a near-tie between two tokens can flip, which says nothing about the
    acceptance rule."""
    config = EngineConfig(speculative=spec, dtype="float32", **kwargs)
    return LLMEngine.from_checkpoint(TARGET, config)


@pytest.fixture(scope="module")
def chat_prompts() -> list[list[int]]:
    """Held-out task prompts of every domain, as the server renders them."""
    from loadtests.bench_speculative import task_prompts

    return task_prompts(_engine(None).tokenizer, 12)


def _params(i: int) -> SamplingParams:
    """Greedy requests with varied limits, stops and logprobs."""
    return SamplingParams(
        max_tokens=[48, 7, 33, 2][i % 4],
        temperature=0.0,
        ignore_eos=i % 3 == 0,
        logprobs=2 if i % 5 == 1 else None,
    )


def _check_blocks(engine: LLMEngine) -> None:
    """Every block is held exactly as often as block tables name it, and no sequence holds
    blocks past its computed tokens and pending drafts."""
    blocks = engine.blocks
    held: dict[int, int] = {}
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        for b in seq.block_table:
            held[b] = held.get(b, 0) + 1
        pending = seq.num_computed_tokens + max(1, len(seq.draft_token_ids))
        assert len(seq.block_table) <= blocks.blocks_needed(pending)
    assert all(blocks.ref_count[b] == n for b, n in held.items())
    assert sum(blocks.ref_count) == sum(held.values())
    assert blocks.num_free_blocks == blocks.num_blocks - len(held)


def _generate_checked(engine: LLMEngine, prompts, params) -> tuple[list, list]:
    """Output deltas per request, checking the blocks after every step; and the sequences."""
    ids = [f"r{i}" for i in range(len(prompts))]
    results = {rid: [] for rid in ids}
    seqs = []
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
        seqs += engine.requests[rid].seqs
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id] += out.outputs
        _check_blocks(engine)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return [results[rid] for rid in ids], seqs


def _flatten(deltas) -> tuple[list[int], str, str | None, list[int]]:
    tokens = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    reason = next((d.finish_reason for d in deltas if d.finish_reason), None)
    return tokens, text, reason, [lp.token_id for d in deltas for lp in d.logprobs]


@pytest.mark.slow
@pytest.mark.parametrize("method", list(SPECS))
def test_greedy_speculation_is_token_identical(method, chat_prompts):
    prompts = chat_prompts
    params = [_params(i) for i in range(len(prompts))]
    plain, _ = _generate_checked(_engine(None), prompts, params)
    engine = _engine(SPECS[method])
    spec, _ = _generate_checked(engine, prompts, params)
    for a, b in zip(plain, spec, strict=True):
        assert _flatten(a) == _flatten(b)
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens > 0  # speculation really ran, and kept tokens
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # and rejected some too
    if method == "draft":
        assert not engine.speculator.proposer.shadows
        draft_blocks = engine.speculator.proposer.blocks
        assert draft_blocks.num_free_blocks == draft_blocks.num_blocks


@pytest.mark.slow
def test_stop_strings_budget_cuts_and_preemption_with_drafts(chat_prompts):
    """Stop strings in the middle of accepted drafts, a token budget that cuts drafts, and
    a cache small enough to preempt: outputs are still those of plain decoding."""
    prompts = chat_prompts[:6]
    reference = _engine(None).generate(prompts, SamplingParams(max_tokens=40, temperature=0))
    params = []
    for out in reference:
        text = out[0].text
        stop = [text[len(text) // 2 : len(text) // 2 + 3]] if len(text) > 8 else []
        params.append(SamplingParams(max_tokens=40, temperature=0.0, stop=stop))
    model = _engine(None).model
    block_bytes = kv_bytes_per_block(model.config, 16, model.embed_tokens.weight.dtype)
    longest = max(map(len, prompts)) + 40
    # Room for the longest request and a little: the others get preempted.
    blocks = longest // 16 + 6
    small = dict(max_num_batched_tokens=48, kv_cache_bytes=blocks * block_bytes)
    plain, _ = _generate_checked(_engine(None, **small), prompts, params)
    draft = ModelConfig.from_file(DRAFT / "config.json")
    # The draft model's cache comes out of the same budget.
    draft_bytes = kv_bytes_per_block(draft, 16, model.embed_tokens.weight.dtype)
    for method in ("mtp", "draft"):
        extra = blocks * draft_bytes if method == "draft" else 0
        engine = _engine(
            SPECS[method], **{**small, "kv_cache_bytes": small["kv_cache_bytes"] + extra}
        )
        spec, seen = _generate_checked(engine, prompts, params)
        assert [_flatten(a) for a in plain] == [_flatten(b) for b in spec]
        assert any(_flatten(a)[2] == "stop" for a in plain)
        assert engine.speculator.stats.num_accepted_tokens > 0
        assert sum(s.num_preemptions for s in seen) > 0


def test_requests_that_cannot_speculate_decode_alone(chat_prompts):
    """Penalties and JSON constraints change the distribution token by token: such
    requests share the batch with speculating ones but never get drafts."""
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    penalised = SamplingParams(max_tokens=32, temperature=0.0, repetition_penalty=1.3)
    constrained = SamplingParams(max_tokens=32, temperature=0.0, json_object=True)
    params = [greedy, penalised, constrained]
    engine = _engine(SPECS["mtp"])
    for i, (prompt, p) in enumerate(zip(chat_prompts[:3], params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    seqs = [engine.requests[f"r{i}"].seqs[0] for i in range(3)]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.outputs)
    assert seqs[0].spec.num_drafts > 0
    assert seqs[1].spec.num_drafts == seqs[2].spec.num_drafts == 0
    plain = _engine(None).generate(chat_prompts[:3], params)
    assert [o[0].token_ids for o in plain] == [_flatten(outputs[f"r{i}"])[0] for i in range(3)]


def test_large_batches_do_not_speculate(chat_prompts):
    spec = SpeculativeConfig(method="draft", model=DRAFT, disable_by_batch_size=2)
    engine = _engine(spec)
    for i, prompt in enumerate(chat_prompts[:6]):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8 + 8 * i, temperature=0))
    busy = quiet = 0
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        drafted = any(s.draft_token_ids for s in running)
        if len(running) > 2:
            assert not drafted
            busy += 1
        quiet += drafted
    assert busy and quiet  # both regimes happened


def test_a_drafter_not_ready_yet_leaves_steps_without_drafts(chat_prompts, monkeypatch):
    """Until a drafter says it is ready (the MTP layer's compiled steps in), steps decode
    without drafts; a request that started meanwhile keeps decoding so (its MTP context
    missed steps), one that starts after drafts."""
    engine = _engine(SpeculativeConfig(method="mtp"))
    ready = False
    monkeypatch.setattr(engine.speculator.proposer, "ready", lambda: ready)
    params = SamplingParams(max_tokens=24, temperature=0)

    def drafts(request_id: str, prompt: list[int]) -> int:
        engine.add_request(request_id, prompt, params)
        drafted = 0
        while engine.has_unfinished():
            engine.step()
            drafted += sum(len(s.draft_token_ids) for s in engine.scheduler.running)
        return drafted

    assert drafts("early", chat_prompts[0]) == 0
    ready = True
    assert drafts("later", chat_prompts[1]) > 0


def test_mtp_drafts_a_sampled_request_by_argmax_without_a_distribution(chat_prompts):
    """The MTP head's argmax, a sampled request's too: the verify step takes such drafts as
    proposed deterministically (q one-hot), which `test_rejection.py` holds exact."""
    engine = _engine(SpeculativeConfig(method="mtp"))
    params = SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=3)
    engine.add_request("sampled", chat_prompts[2], params)
    drafted = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            drafted += len(seq.draft_token_ids)
            assert seq.draft_probs is None
    assert drafted > 0


def test_lookahead_follows_acceptance():
    free, dear = StepCost(fixed=0.5, per_draft=0.0), StepCost(fixed=0.5, per_draft=0.25)
    assert best_lookahead(0.95, free, 8) == 8  # cheap, accurate drafts: draft far
    assert 1 <= best_lookahead(0.9, dear, 8) < 8  # costly drafts: stop earlier
    assert best_lookahead(0.3, dear, 8) == 0  # drafts that miss: do not speculate


def test_config_validation_and_vllm_names():
    assert SpeculativeConfig.model_validate({"method": "deepseek_mtp"}).method == "mtp"
    cfg = SpeculativeConfig.model_validate({"method": "draft_model", "model": "m"})
    assert cfg.method == "draft" and cfg.model == Path("m")
    for bad in (
        {"method": "draft"},  # no model
        {"method": "ngram", "model": "m"},
        {"method": "eagle"},
        {"method": "ngram", "num_speculative_tokens": 0},
        {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2},
        {"method": "ngram", "typo": 1},
    ):
        with pytest.raises(ValueError):
            SpeculativeConfig.model_validate(bad)


def test_mtp_needs_mtp_weights():
    with pytest.raises(ValueError, match="MTP weights"):
        LLMEngine.from_checkpoint(DRAFT, EngineConfig(speculative=SpeculativeConfig(method="mtp")))


def test_ngram_lookup_takes_the_latest_longest_match():
    from speculative.ngram import ngram_lookup

    tokens = torch.tensor([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert ngram_lookup(tokens, 3, 1, 3) == [7, 8, 5]  # "2 3" last seen before 7 8 5
    assert ngram_lookup(torch.tensor([4, 5, 6]), 3, 1, 3) == []


def test_the_draft_models_cache_shares_the_kv_budget() -> None:
    """The drafter keeps as many blocks as the target, so both caches fit the one budget."""
    budget = 4 << 20
    engine = _engine(SPECS["draft"], kv_cache_bytes=budget)
    target = engine.model
    drafter = engine.speculator.proposer.paged.model
    per_block = sum(
        kv_bytes_per_block(m.config, 16, m.embed_tokens.weight.dtype) for m in (target, drafter)
    )
    assert engine.blocks.num_blocks == budget // per_block
    assert engine.speculator.proposer.blocks.num_blocks == engine.blocks.num_blocks


@pytest.mark.slow
def test_compiled_mtp_drafter_keeps_plain_greedy_tokens(chat_prompts, tmp_path, monkeypatch):
    """The MTP draft step compiled beside the target's decode steps: the engine is warm only
    once both are built, drafts go through its graph (catch-ups of several positions and
    chained single rows, some in chunks of the graph's size), whole graphs are stored, and
    greedy outputs are still those of plain decoding."""
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(llm_engine, "graph_sizes", lambda n, verify_rows: [2])  # one graph each
    prompts = chat_prompts[:4]
    params = [_params(i) for i in range(len(prompts))]
    plain, _ = _generate_checked(_engine(None), prompts, params)
    engine = _engine(SPECS["mtp"], enforce_eager=False)
    graphs = engine.speculator.proposer.graphs
    assert engine.graphs == [engine.runner.paged.graphs, graphs]
    assert engine.warmup() == (0, 2, False, False)
    engine.wait_warm()
    assert engine.warmup() == (2, 2, True, True)
    rows = []
    draft = graphs.draft
    graphs.draft = lambda hidden, ids, *a: (rows.append(len(ids)), draft(hidden, ids, *a))[1]
    spec, _ = _generate_checked(engine, prompts, params)
    assert [_flatten(d) for d in spec] == [_flatten(d) for d in plain]
    assert max(rows) > 2 and 1 in rows  # catch-ups in chunks, and single chained drafts
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens > stats.num_draft_tokens / 2
    assert len(list((tmp_path / "cache" / "graphs").iterdir())) == 2
