"""The engine serving a hybrid (Qwen3-Next) model: its tokens against our reference model's
full forward (itself tested against transformers), through chunked prefill, continuous
batching, preemption and n > 1; the paged forward's hidden states against one forward.

fp32 throughout, so greedy tokens must agree exactly.
"""

from pathlib import Path

import pytest
import torch

from serving.engine.block_manager import BlockManager
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.engine.scheduler import Scheduler
from serving.engine.sequence import Sequence
from serving.engine.state_slots import StateSlots
from serving.model.checkpoint import check_checkpoint
from serving.model.hybrid.checkpoint import load_hybrid_checkpoint
from serving.model.hybrid.config import HybridConfig
from serving.model.hybrid.paged import PagedHybridModel, hybrid_kv_bytes_per_block
from serving.model.hybrid.slots import state_bytes_per_slot
from serving.model.spans import TokenSpan
from serving.sampling.params import SamplingParams
from speculative.config import SpeculativeConfig
from tests.serving.model.hybrid_tiny import (
    VOCAB,
    write_hybrid_checkpoint,
    write_served_hybrid_checkpoint,
)

pytest.importorskip("transformers")  # writes the checkpoints

LENGTHS = [5, 40, 70, 1]  # 70 crosses the delta rule's 64-token chunk; 1: a one-token prompt
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hybrid")
    # L F L F with a dense layer: two full-attention layers on the paged cache.
    write_hybrid_checkpoint(path, full_attention_interval=2, mlp_only_layers=[1])
    return path


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> torch.nn.Module:
    return load_hybrid_checkpoint(checkpoint)


def _prompts(lengths: list[int] = LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def _greedy(reference: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding by one full forward over the whole sequence per token, no state."""
    ids = list(prompt)
    for _ in range(steps):
        hidden, _ = reference(torch.tensor([ids]))
        ids.append(int(reference.compute_logits(hidden[0, -1]).argmax()))
    return ids[len(prompt) :]


def _engine(checkpoint: Path, **config: object) -> LLMEngine:
    model = load_hybrid_checkpoint(checkpoint)
    cfg = EngineConfig(**({"kv_cache_bytes": 1 << 20} | config))
    return LLMEngine(model, cfg, eos_token_ids=[])


def _tokens(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    return [[o.token_ids for o in outs] for outs in engine.generate(prompts, params)]


def test_greedy_equals_full_forward_alone_and_batched(checkpoint, reference):
    prompts = _prompts()
    expected = [[_greedy(reference, p, GREEDY.max_tokens)] for p in prompts]
    engine = _engine(checkpoint)
    assert _tokens(engine, prompts, GREEDY) == expected  # one continuous batch
    for prompt, want in zip(prompts, expected, strict=True):
        assert _tokens(engine, [prompt], GREEDY) == [want]  # each alone, slots reused
    assert sorted(engine.state_slots.free) == list(range(engine.state_slots.num_slots))


def test_requests_joining_a_running_batch(checkpoint, reference):
    """Continuous batching: requests arrive while others decode (and one is aborted midway,
    giving its slot to a later one); each gets the tokens it gets alone."""
    prompts = _prompts([20, 50, 7, 33], seed=6)
    engine = _engine(checkpoint, max_num_seqs=3, max_num_batched_tokens=32)
    got: dict[str, list[int]] = {}
    arrivals = {0: [0], 2: [1, 2], 5: [3]}  # step -> prompts added before it
    for step in range(200):
        for i in arrivals.get(step, []):
            engine.add_request(f"r{i}", prompts[i], GREEDY)
        if step == 3:
            assert engine.abort("r0")
        for out in engine.step():
            for delta in out.outputs:
                got.setdefault(out.request_id, []).extend(delta.token_ids)
        if step > max(arrivals) and not engine.has_unfinished():
            break
    for i in (1, 2, 3):
        assert got[f"r{i}"] == _greedy(reference, prompts[i], GREEDY.max_tokens)
    assert sorted(engine.state_slots.free) == [0, 1, 2]


def test_chunked_prefill_equals_unchunked(checkpoint, reference):
    prompts = _prompts(seed=1)
    whole = _tokens(_engine(checkpoint), prompts, GREEDY)
    assert _tokens(_engine(checkpoint, max_num_batched_tokens=16), prompts, GREEDY) == whole
    assert whole == [[_greedy(reference, p, GREEDY.max_tokens)] for p in prompts]


def test_preemption_recomputes_the_same_tokens(checkpoint, monkeypatch):
    prompts = _prompts([40, 60, 50, 30], seed=2)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    roomy = _tokens(_engine(checkpoint), prompts, params)
    preempted = []
    original = Scheduler._preempt

    def count(self: Scheduler, seq: Sequence) -> None:
        assert seq.state_slot is not None  # a running sequence holds its slot until here
        preempted.append(seq.seq_id)
        original(self, seq)
        assert seq.state_slot is None

    monkeypatch.setattr(Scheduler, "_preempt", count)
    # Slots for every sequence, KV blocks for about two of them at once.
    config = HybridConfig.from_file(checkpoint / "config.json")
    slot_bytes = 4 * state_bytes_per_slot(config, torch.float32)
    block_bytes = hybrid_kv_bytes_per_block(config, 16, torch.float32)
    tight = _engine(checkpoint, max_num_seqs=4, kv_cache_bytes=slot_bytes + 12 * block_bytes)
    assert tight.blocks.num_blocks == 12
    assert _tokens(tight, prompts, params) == roomy
    assert preempted


def test_few_slots_admit_in_turn(checkpoint):
    """Two slots for four requests: the others wait for a slot, not for blocks."""
    prompts = _prompts(seed=3)
    engine = _engine(checkpoint, max_num_seqs=2)
    assert engine.state_slots.num_slots == 2
    assert _tokens(engine, prompts, GREEDY) == _tokens(_engine(checkpoint), prompts, GREEDY)


def test_state_slots_are_taken_and_given_back():
    slots = StateSlots(2)
    seqs = [Sequence("r", [1], SamplingParams()) for _ in range(3)]
    assert slots.allocate(seqs[0]) and slots.allocate(seqs[1])
    assert {seqs[0].state_slot, seqs[1].state_slot} == {0, 1}
    assert not slots.allocate(seqs[2]) and seqs[2].state_slot is None
    assert slots.allocate(seqs[0])  # already holds one: keeps it
    slots.release(seqs[0])
    assert seqs[0].state_slot is None and slots.allocate(seqs[2])


def test_admission_needs_a_slot_as_well_as_blocks():
    """Blocks and sequence places to spare, one slot: the second waits until the first
    finishes; a preempted sequence gives its slot back."""
    scheduler = Scheduler(BlockManager(64, 16, False), 4, 512, StateSlots(1))
    first, second = (Sequence(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(2))
    scheduler.add(first)
    scheduler.add(second)
    assert [seq for seq, _ in scheduler.schedule().scheduled] == [first]
    assert second.state_slot is None and list(scheduler.waiting) == [second]
    scheduler.finish(first)
    assert [seq for seq, _ in scheduler.schedule().scheduled] == [second]
    scheduler.running.remove(second)
    scheduler._preempt(second)
    assert second.state_slot is None and scheduler.state_slots.free == [0]


@pytest.mark.parametrize(
    ("length", "config"),
    [
        (30, {}),  # forks at 29: one full block shared, the partly filled one copied
        (33, {"max_num_batched_tokens": 8}),  # at 32, block-aligned: nothing copied; chunked
        (30, {"max_num_seqs": 2}),  # the third sample finds no slot: it computes alone later
    ],
)
def test_n_samples_fork_the_prompt(checkpoint, reference, monkeypatch, length, config):
    """n = 3 greedy samples are the greedy tokens; seeded samples i equal requests seeded
    seed + i. The samples fork the first one's prompt state unless no slot is free."""
    forks = []
    original = PagedHybridModel.fork

    def count(self, parent_slot, child_slot, block_copies):
        forks.append(len(block_copies))
        original(self, parent_slot, child_slot, block_copies)

    monkeypatch.setattr(PagedHybridModel, "fork", count)
    [prompt] = _prompts([length], seed=4)
    engine = _engine(checkpoint, **config)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=3)
    assert _tokens(engine, [prompt], greedy) == [[_greedy(reference, prompt, 6)] * 3]
    copies = 0 if length % 16 == 1 else 1
    assert forks == [copies] * (1 if config.get("max_num_seqs") == 2 else 2)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True, n=2)
    [together] = _tokens(engine, [prompt], sampled)
    alone = [
        _tokens(engine, [prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=s))[0][0]
        for s in (7, 8)
    ]
    assert together == alone


@torch.no_grad()
def test_paged_forward_equals_one_forward(checkpoint, reference):
    """Prefill chunks, then a mixed step (one sequence decoding, one still prefilling), then
    decodes: each position's final hidden state equals that of one forward over the whole
    sequence."""
    model = load_hybrid_checkpoint(checkpoint)
    paged = PagedHybridModel(model, num_blocks=16, block_size=16, num_slots=3)
    a, b = _prompts([45, 90], seed=5)
    tables = {0: list(range(0, 4)), 2: list(range(4, 12))}  # slots 0 and 2, each its blocks
    plans = [
        [(2, 0, 33), (0, 0, 20)],
        [(0, 20, 25), (2, 33, 40)],
        [(0, 45, 1), (2, 73, 17)],  # decodes first, as the runner orders a step
    ]
    got = {0: [], 2: []}
    ids = {0: [*a, 3], 2: b}
    for plan in plans:
        spans = [TokenSpan(tables[s], p, ids[s][p : p + n], s) for s, p, n in plan]
        hidden = paged.forward(spans)
        offset = 0
        for s, _, n in plan:
            got[s].append(hidden[offset : offset + n])
            offset += n
    for slot, tokens in ids.items():
        whole, _ = reference(torch.tensor([tokens]))
        assert (torch.cat(got[slot]) - whole[0]).abs().max() <= 1e-4


def test_from_checkpoint_serves_a_hybrid_checkpoint(tmp_path):
    write_served_hybrid_checkpoint(tmp_path)
    assert check_checkpoint(tmp_path) == "float32"  # what `tierserve serve` checks of a tier
    engine = LLMEngine.from_checkpoint(tmp_path, EngineConfig(kv_cache_bytes=1 << 20))
    assert engine.state_slots is not None and not engine.blocks.enable_prefix_caching
    [[out]] = engine.generate([engine.tokenizer.encode("hello")], GREEDY)
    assert len(out.token_ids) == GREEDY.max_tokens
    with pytest.raises(ValueError, match="MTP speculative decoding is not supported"):
        LLMEngine.from_checkpoint(
            tmp_path, EngineConfig(speculative=SpeculativeConfig(method="mtp"))
        )


def test_speculative_greedy_equals_plain_greedy(checkpoint, reference):
    """n-gram drafts verified against the DeltaNet state kept after every draft: each
    sequence goes on from its state after the last accepted token, so greedy tokens equal
    plain greedy decoding and their logprobs plain decoding's, in a batch, through accepted
    and rejected drafts alike."""
    prompts = _prompts([12, 30, 9], seed=3)
    prompts = [p + p[:6] + p + p[:6] for p in prompts]  # repeats for the n-gram drafter
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    expected = [_greedy(reference, p, params.max_tokens) for p in prompts]
    [plain] = zip(*_engine(checkpoint, max_num_seqs=3).generate(prompts, params), strict=True)
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    engine = _engine(checkpoint, speculative=speculative, max_num_seqs=3)
    got: dict[str, list] = {}
    counts = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].logprobs)
            if out.finished:
                counts.append(out.spec)
    for i, want in enumerate(expected):
        assert [lp.token_id for lp in got[f"r{i}"]] == want == plain[i].token_ids
        torch.testing.assert_close(
            torch.tensor([lp.logprob for lp in got[f"r{i}"]]),
            torch.tensor([lp.logprob for lp in plain[i].logprobs]),
            atol=1e-4,
            rtol=0,
        )
    drafted = sum(c.num_draft_tokens for c in counts)
    accepted = sum(c.num_accepted_tokens for c in counts)
    assert 0 < accepted < drafted  # drafts were both kept and rejected
    linear = [layer.linear_attn for layer in engine.model.layers if layer.is_linear]
    assert all(not layer.verify_states for layer in linear)  # none left behind
