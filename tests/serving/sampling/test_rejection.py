"""Speculative sampling draws from the target's distribution: chi-square tests on tiny
vocabularies, against the exact distribution computed from the target model."""

import itertools

import pytest
import torch

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import load_checkpoint
from serving.sampling.filters import filter_logits
from serving.sampling.params import SamplingParams
from serving.sampling.rejection import processed_probs, verify_drafts
from speculative import speculator
from speculative.config import SpeculativeConfig

VOCAB = 5
PROMPT = [1, 2, 3]


def _save_dense(path, seed: int):
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)  # peaked distributions, unlike the near-uniform init
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-dense")
    return _save_dense(root / "target", 0), _save_dense(root / "draft", 1)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts under probs; cells expecting < 5 are pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2))


@torch.no_grad()
def joint(path, params: SamplingParams, length: int) -> torch.Tensor:
    """Exact probability of every continuation of PROMPT of `length` tokens, [VOCAB^length]."""
    model = load_checkpoint(path).eval()
    out = []
    for tail in itertools.product(range(VOCAB), repeat=length):
        ids = torch.tensor([PROMPT + list(tail)])
        hidden = model(ids, torch.arange(ids.shape[1])[None])
        logits = model.compute_logits(hidden[0, len(PROMPT) - 1 : -1])
        probs = processed_probs(logits, params)
        out.append(float(probs[torch.arange(length), torch.tensor(tail)].prod()))
    return torch.tensor(out)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_p=0.8),
        SamplingParams(temperature=1.2, top_k=3, min_p=0.05),
        SamplingParams(temperature=0.9, top_k=4, top_p=0.9),
    ],
    ids=["plain", "top_p", "top_k_min_p", "top_k_top_p"],
)
def test_verify_drafts_keeps_the_target_distribution(params):
    """The first token verify emits is distributed as the target's p at position 0, with a
    sampling drafter (q) and a deterministic one (one-hot q); 8,000 draws each."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=g)
    p0 = processed_probs(logits, params)[0]
    q = processed_probs(torch.randn(2, VOCAB, generator=g) * 1.5, params)
    for draft_probs in (q, None):
        counts = torch.zeros(VOCAB)
        for _ in range(8_000):
            if draft_probs is None:
                drafts = [int(torch.argmax(q[0])), int(torch.argmax(q[1]))]
            else:
                drafts = torch.multinomial(draft_probs, 1, generator=g).squeeze(1).tolist()
            counts[verify_drafts(logits, drafts, draft_probs, params, g)[0]] += 1
        assert chi_square_p(counts, p0) > 1e-3
    # The test can fail: the target keeps several tokens, and the drafter's own
    # distribution is far from it.
    assert (p0 > 0.05).sum() >= 2
    assert (p0 - q[0]).abs().sum() / 2 > 0.2


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.85),
        SamplingParams(temperature=1.0, top_k=2, min_p=0.3),
    ],
)
def test_a_top_k_cut_gives_the_distributions_of_the_whole_vocabulary(params):
    """With a top_k the k best columns alone are filtered and normalised: the same
    distributions as filtering every column (min_p, top_k, top_p) and normalising them."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(4)) * 3
    scaled = logits / params.temperature
    whole = filter_logits(scaled, [params] * 5).softmax(dim=-1)
    got = processed_probs(logits, params)
    torch.testing.assert_close(got, whole)
    assert ((got > 0).sum(-1) <= params.top_k).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, top_p=0.8)],
    ids=["plain", "top_p"],
)
def test_engine_speculative_sampling_matches_the_target(models, params, monkeypatch):
    """3-token continuations through the engine with a draft model (always drafting as far
    as max_tokens allows) against the exact joint distribution of the target: 125 cells."""
    target, draft = models
    monkeypatch.setattr(speculator, "best_lookahead", lambda rate, cost, max_k: max_k)
    spec = SpeculativeConfig(method="draft", model=draft, disable_by_batch_size=None)
    engine = LLMEngine(
        load_checkpoint(target), EngineConfig(speculative=spec, max_num_seqs=256), None, []
    )
    n = 4000
    p = SamplingParams(max_tokens=3, temperature=params.temperature, top_p=params.top_p)
    outs = engine.generate([PROMPT] * n, p)
    counts = torch.zeros(VOCAB**3)
    for out in outs:
        a, b, c = out[0].token_ids
        counts[a * VOCAB * VOCAB + b * VOCAB + c] += 1
    stats = engine.speculator.stats
    assert stats.num_draft_tokens >= n  # every request verified at least one draft
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert chi_square_p(counts, joint(target, p, 3)) > 1e-3
    tv = (joint(target, p, 3) - joint(draft, p, 3)).abs().sum() / 2
    assert tv > 0.2  # a sampler that kept the draft's distribution would fail


def test_seeded_requests_repeat_with_speculation(models):
    target, draft = models
    spec = SpeculativeConfig(method="draft", model=draft, disable_by_batch_size=None)
    engine = LLMEngine(load_checkpoint(target), EngineConfig(speculative=spec), None, [])
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=s) for s in (5, 5, 6)]
    first = [o[0].token_ids for o in engine.generate([PROMPT] * 3, params)]
    alone = engine.generate([PROMPT], params[0])[0][0].token_ids
    assert first[0] == first[1] == alone  # the same seed, whatever else is in the batch
    assert first[2] != first[0]
    assert engine.speculator.stats.num_drafts > 0
