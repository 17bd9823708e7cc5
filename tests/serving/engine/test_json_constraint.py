"""json_object constrained decoding: the token constraint over a byte-level vocabulary, the
sampler's constrained draws, and the engine end to end."""

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
import tokenizers
import torch

from serving.api_server.protocol import ChatCompletionRequest
from serving.engine.json_constraint import JsonObjectConstraint
from serving.engine.json_validator import MAX_WHITESPACE, JsonValidator
from serving.engine.llm_engine import EngineConfig, EngineInputError, LLMEngine
from serving.engine.outputs import SequenceOutput
from serving.engine.token_vocabulary import json_vocabulary
from serving.model.causal_lm import CausalLM
from serving.model.config import ModelConfig
from serving.sampling.params import SamplingParams, SamplingRow
from serving.sampling.sampler import Sampler
from tests.serving.engine.test_json_validator import is_json_object
from tests.tiny_models import TINY_MOE

# -- the constraint over a tokenizer's vocabulary --------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer: tokenizers.Tokenizer):
    vocab = json_vocabulary(tiny_tokenizer)
    eos = tiny_tokenizer.token_to_id("<|im_end|>")
    return tiny_tokenizer, vocab, eos


def test_vocabulary_is_built_once_and_decodes_like_the_tokenizer(tiny):
    tok, vocab, _ = tiny
    assert json_vocabulary(tok) is vocab and len(vocab) == tok.get_vocab_size()
    specials = [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert all(vocab.token_bytes[i] is None for i in specials)
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(len(vocab)) for _ in range(rng.randint(1, 8))]
        data = b"".join(vocab.token_bytes[i] or b"" for i in ids)
        assert data.decode("utf-8", "replace") == tok.decode(ids)
    assert any(b and b[-1] >= 0xC0 for b in vocab.token_bytes)  # tokens do split characters


def test_only_byte_level_tokenizers_are_supported():
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0}, unk_token="a"))
    with pytest.raises(ValueError, match="byte-level"):
        json_vocabulary(word_level)


def check_mask(c: JsonObjectConstraint, size: int) -> torch.Tensor:
    mask = c.allowed_mask(size)
    assert mask.shape == (size,) and mask.dtype == torch.bool
    assert mask.tolist() == [c.allows(i) for i in range(size)]
    assert mask.any()  # never a dead end
    return mask


def test_a_document_tokenized_is_allowed_token_by_token(tiny):
    tok, vocab, eos = tiny
    text = ' {"héllo": ["wörld", -1.5e3, {"日本語": null, "😀": true}], "naïve": "café"}'
    c = JsonObjectConstraint(vocab, [eos])
    ids = tok.encode(text).ids
    for t in ids:
        assert not c.complete and not c.allows(eos)
        check_mask(c, len(vocab))
        c.advance(t)
    assert c.complete
    assert check_mask(c, len(vocab) + 4).nonzero().flatten().tolist() == [eos]
    c.advance(eos)
    assert c.complete
    with pytest.raises(ValueError):
        c.advance(ids[0])


def test_random_constrained_walks_stay_valid_and_the_mask_is_exact(tiny):
    tok, vocab, eos = tiny
    specials = {tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>")}
    rng = random.Random(0)
    finished = 0
    for _ in range(12):
        c, ids = JsonObjectConstraint(vocab, [eos]), []
        for _ in range(60):
            mask = check_mask(c, len(vocab) + 3)  # + columns past the tokenizer (padding)
            assert not mask[len(vocab) :].any() and not mask[list(specials)].any()
            allowed = mask.nonzero().flatten().tolist()
            # Lean towards one-byte tokens, so that some walks close their object.
            short = [t for t in allowed if t == eos or len(vocab.token_bytes[t]) == 1]
            t = rng.choice(short if short and rng.random() < 0.7 else allowed)
            if t == eos:
                break
            c.advance(t)
            ids.append(t)
            assert JsonValidator().accepts(tok.decode(ids).encode())
        if c.complete:
            finished += 1
            assert isinstance(json.loads(tok.decode(ids)), dict)
    assert finished >= 1


def test_too_much_whitespace_is_refused_in_tokens(tiny):
    tok, vocab, eos = tiny
    c = JsonObjectConstraint(vocab, [eos])
    space = tok.token_to_id("Ġ")  # the byte-level symbol for " "
    for _ in range(MAX_WHITESPACE):
        c.advance(space)
    assert not c.allows(space)
    allowed = c.allowed_mask(len(vocab)).nonzero().flatten().tolist()
    assert tok.token_to_id("{") in allowed
    assert all(vocab.token_bytes[t].startswith(b"{") for t in allowed)


# -- the sampler -----------------------------------------------------------------------------


def constraint_at(tiny, prefix: str) -> JsonObjectConstraint:
    tok, vocab, eos = tiny
    c = JsonObjectConstraint(vocab, [eos])
    for t in tok.encode(prefix).ids:
        c.advance(t)
    return c


def skewed_logits(vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab_size, generator=g)
    logits[torch.randperm(vocab_size, generator=g)[:6]] += 6.0
    return logits


def peaked_logits(mask: torch.Tensor, disallowed: int) -> torch.Tensor:
    """Four allowed tokens and `disallowed` rejected ones more likely than them; the rest
    negligible. With 4 the best-first tries find an allowed token, with 20 the mask must."""
    logits = torch.randn(mask.shape[0], generator=torch.Generator().manual_seed(0)) - 12.0
    allowed, rejected = mask.nonzero().flatten(), (~mask).nonzero().flatten()
    logits[allowed[:4]] = torch.tensor([2.0, 1.0, 0.5, 0.0])
    logits[rejected[:disallowed]] = 3.0
    return logits


def masked_probs(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~mask, -math.inf).softmax(-1)


def draw_many(tiny, c: JsonObjectConstraint, logits: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """Token frequencies over n seeded rows sampled as one batch."""
    _, vocab, eos = tiny
    rows = [
        SamplingRow(SamplingParams(seed=s, **kw), [1], [], torch.Generator().manual_seed(s), c)
        for s in range(n)
    ]
    tokens = Sampler(len(vocab), [eos])(logits.expand(n, -1), rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=len(vocab)) / n


@pytest.mark.parametrize("disallowed", [4, 20])
@pytest.mark.parametrize("prefix", ["{", '{"a": 1', '{"a": "b'])
def test_constrained_sampling_is_the_masked_distribution(tiny, prefix, disallowed):
    c = constraint_at(tiny, prefix)
    mask = c.allowed_mask(len(tiny[1]))
    logits = peaked_logits(mask, disallowed)
    expected = masked_probs(logits, mask)
    freq = draw_many(tiny, c, logits, 2000, temperature=1.0)
    assert freq[~mask].sum() == 0
    assert 0.5 * (freq - expected).abs().sum() < 0.05  # total variation


def test_filters_apply_to_the_masked_distribution_as_in_vllm(tiny):
    c = constraint_at(tiny, '{"a": ')
    mask = c.allowed_mask(len(tiny[1]))
    logits = peaked_logits(mask, 4)
    top3 = torch.zeros_like(mask)
    top3[logits.masked_fill(~mask, -math.inf).topk(3).indices] = True
    freq = draw_many(tiny, c, logits, 2000, temperature=1.0, top_k=3)
    assert 0.5 * (freq - masked_probs(logits, top3)).abs().sum() < 0.05


def test_greedy_takes_the_best_allowed_token_and_logprobs_stay_raw(tiny):
    _, vocab, eos = tiny
    sampler = Sampler(len(vocab), [eos])
    for seed, prefix in enumerate(["", "{", '{"a": [1', '{"a": "x', '{"a": t']):
        logits = skewed_logits(len(vocab), seed).unsqueeze(0)
        c = constraint_at(tiny, prefix)
        best = int(logits[0].masked_fill(~c.allowed_mask(len(vocab)), -math.inf).argmax())
        for kw in ({}, {"logprobs": 1}):  # the all-greedy fast path, then the general one
            row = SamplingRow(SamplingParams(temperature=0.0, **kw), [1], [], None, c)
            result = sampler(logits, [row])
            assert result.token_ids == [best]
        assert result.logprobs[0].logprob == pytest.approx(float(logits[0].log_softmax(-1)[best]))


def test_seeded_constrained_rows_do_not_depend_on_the_batch(tiny):
    _, vocab, eos = tiny

    def run(others: int) -> list[int]:
        sampler, c, tokens = Sampler(len(vocab), [eos]), JsonObjectConstraint(vocab, [eos]), []
        row = SamplingRow(SamplingParams(seed=7), [1], [], torch.Generator().manual_seed(7), c)
        plain = [SamplingRow(SamplingParams(temperature=1.0), [1], []) for _ in range(others)]
        for step in range(30):
            logits = torch.stack(
                [skewed_logits(len(vocab), 1000 * j + step) for j in range(others, -1, -1)]
            )
            token = sampler(logits, [*plain, row]).token_ids[-1]
            if token == eos:
                break
            c.advance(token)
            tokens.append(token)
        return tokens

    assert run(0) == run(3)


def test_the_constraint_overrides_min_tokens(tiny):
    _, vocab, eos = tiny
    closed = constraint_at(tiny, "{}")  # only EOS may follow, and min_tokens masks it
    only_braces = constraint_at(tiny, " " * MAX_WHITESPACE)  # "{" tokens, all stop tokens
    braces = only_braces.allowed_mask(len(vocab)).nonzero().flatten().tolist()
    logits = skewed_logits(len(vocab), 0).unsqueeze(0)
    for temperature in (0.0, 1.0):
        for c, expected in ((closed, [eos]), (only_braces, braces)):
            params = SamplingParams(temperature=temperature, min_tokens=50, stop_token_ids=braces)
            row = SamplingRow(params, [1], [], None, c)
            assert Sampler(len(vocab), [eos])(logits, [row]).token_ids[0] in expected


# -- end to end ------------------------------------------------------------------------------

SEEDS = range(5)


@pytest.fixture(scope="module")
def engine(random_checkpoint: Path) -> LLMEngine:
    return LLMEngine.from_checkpoint(random_checkpoint)


@pytest.fixture(scope="module")
def generations(engine: LLMEngine) -> dict[str, SequenceOutput]:
    """One batched run: per seed, json_object (also with ignore_eos and with min_tokens) and
    unconstrained; and greedy json_object."""
    cases = {}
    for s in SEEDS:
        params = SamplingParams(json_object=True, seed=s, max_tokens=200)
        cases[f"json-{s}"] = params
        cases[f"json-{s}-ignore-eos"] = dataclasses.replace(params, ignore_eos=True)
        cases[f"json-{s}-min-tokens"] = dataclasses.replace(params, min_tokens=150)
        cases[f"plain-{s}"] = dataclasses.replace(params, json_object=False)
    cases["greedy"] = SamplingParams(json_object=True, temperature=0.0, max_tokens=200)
    prompt = engine.tokenizer.encode("Answer in JSON. What is the capital of France?")
    outputs = engine.generate([prompt] * len(cases), list(cases.values()))
    return {name: out[0] for name, out in zip(cases, outputs, strict=True)}


def test_json_object_outputs_are_json_objects_or_their_prefixes(generations):
    stopped = 0
    for name, out in generations.items():
        if name.startswith("plain"):
            continue
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict), out.text
            stopped += 1
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 200
            assert not is_json_object(out.text) and JsonValidator().accepts(out.text.encode())
    assert stopped >= 3


def test_without_the_constraint_the_random_model_writes_no_json(generations):
    for s in SEEDS:
        assert not is_json_object(generations[f"plain-{s}"].text)
        assert generations[f"plain-{s}"].text != generations[f"json-{s}"].text


def test_a_closed_object_ends_on_eos_despite_ignore_eos_and_min_tokens(generations):
    early = 0
    for s in SEEDS:
        out = generations[f"json-{s}"]
        assert generations[f"json-{s}-ignore-eos"] == out  # ignore_eos does not sample
        with_min = generations[f"json-{s}-min-tokens"]
        if with_min.finish_reason == "stop":
            early += len(with_min.token_ids) < 150
    assert early >= 1


def test_json_object_needs_a_tokenizer():
    config = ModelConfig.from_dict({**TINY_MOE, "architectures": ["Qwen3MoeForCausalLM"]})
    engine = LLMEngine(CausalLM(config), EngineConfig(kv_cache_bytes=1 << 20))
    with pytest.raises(EngineInputError, match="tokenizer"):
        engine.add_request("r", [1, 2], SamplingParams(json_object=True))


@pytest.mark.parametrize(
    ("fmt", "expected"), [(None, False), ("text", False), ("json_object", True)]
)
def test_response_format_json_object_sets_json_object(fmt, expected):
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        response_format=None if fmt is None else {"type": fmt},
    )
    assert request.to_sampling_params(16, {}).json_object is expected
