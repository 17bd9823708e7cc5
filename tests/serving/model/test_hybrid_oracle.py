"""Our Qwen3-Next (hybrid attention) against transformers' `Qwen3NextForCausalLM` on the same
checkpoint, prefill + decode through the per-sequence state against one forward, and bad
checkpoints refused.

Logits are compared on real tokens only. On padding the two models compute different things,
neither of which anything reads: transformers zeroes a padded token's hidden state before each
DeltaNet layer (so that left padding starts the recurrence from zeros), while we leave it and
instead give padding no decay and no write, so that a right-padded row's state after a call is
its state after its last real token.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from serving.model.config import CheckpointError  # noqa: E402
from serving.model.hybrid.checkpoint import load_hybrid_checkpoint  # noqa: E402
from serving.model.hybrid.config import FULL, LINEAR, HybridConfig  # noqa: E402
from tests.serving.model.hybrid_tiny import TINY, VOCAB, hf_hybrid_model  # noqa: E402

CASES = {
    # L F L F, layer 1 dense
    "interval-2": dict(full_attention_interval=2, mlp_only_layers=[1]),
    # L L L F, tied head, top-k weights not renormalised, sparse every other layer
    "interval-4": dict(
        full_attention_interval=4,
        tie_word_embeddings=True,
        norm_topk_prob=False,
        decoder_sparse_step=2,
    ),
}
LENGTHS = [70, 5, 33]  # the longest crosses a 64-token chunk


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = hf_hybrid_model(**CASES[request.param])
    hf.save_pretrained(path)
    return hf, path


def _batch(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.randint(0, VOCAB, (len(lengths), width), generator=g) * mask
    return ids, mask


def _logits(model, ids, mask=None, state=None):
    hidden, state = model(ids, mask, state)
    return model.compute_logits(hidden), state


@torch.no_grad()
def test_logits_match_transformers(checkpoint):
    hf, path = checkpoint
    ours = load_hybrid_checkpoint(path)
    ids, mask = _batch()
    ref = hf(input_ids=ids, attention_mask=mask.long()).logits
    got, state = _logits(ours, ids, mask)
    assert state is None
    diff = (got - ref).abs()[mask]
    assert diff.max() <= 1e-4, diff.max()
    # An unpadded batch too (transformers skips its padding path then).
    ref = hf(input_ids=ids[:1, :40]).logits
    assert (_logits(ours, ids[:1, :40])[0] - ref).abs().max() <= 1e-4


@torch.no_grad()
def test_bf16_matches_transformers_bf16(checkpoint):
    """In bf16 the two round at the same places: they agree far closer than either does with
    fp32 (the bound is a fifth of transformers' own bf16-to-fp32 gap on this model)."""
    _, path = checkpoint
    ours = load_hybrid_checkpoint(path, dtype=torch.bfloat16)
    hf = transformers.Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids, mask = _batch()
    ref = hf(input_ids=ids, attention_mask=mask.long()).logits.float()
    assert (_logits(ours, ids, mask)[0] - ref).abs()[mask].max() <= 1e-3


@torch.no_grad()
def test_prefill_then_decode_equals_one_forward(checkpoint):
    """Rows of different prompt lengths: a padded prefill, a padded multi-token continuation
    (the chunked rule from a state), then single-token steps, each row continuing its own
    sequence; every real position's logits equal those of one forward over the whole rows."""
    _, path = checkpoint
    ours = load_hybrid_checkpoint(path)
    prompt, middle, steps = [20, 3, 9], [5, 7, 1], 6
    total = [p + m + steps for p, m in zip(prompt, middle, strict=True)]
    ids, mask = _batch(total, seed=2)
    whole, _ = _logits(ours, ids, mask)

    state = ours.empty_state(len(total))
    got = [[] for _ in total]
    start = [0] * len(total)
    for lengths in (prompt, middle, *[[1] * len(total)] * steps):
        width = max(lengths)
        chunk = torch.zeros(len(total), width, dtype=torch.long)
        for b, (s, n) in enumerate(zip(start, lengths, strict=True)):
            chunk[b, :n] = ids[b, s : s + n]
        chunk_mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        logits, state = _logits(ours, chunk, chunk_mask, state)
        for b, n in enumerate(lengths):
            got[b].append(logits[b, :n])
            start[b] += n
    assert state.lengths.tolist() == total
    worst = max(
        (torch.cat(got[b]) - whole[b, : total[b]]).abs().max().item() for b in range(len(total))
    )
    assert worst <= 1e-4, worst


@torch.no_grad()
def test_decode_matches_transformers_cached_decode(checkpoint):
    """Our state steps against transformers' cache (its recurrent rule and conv update)."""
    hf, path = checkpoint
    ours = load_hybrid_checkpoint(path)
    ids, _ = _batch([30], seed=4)
    out = hf(input_ids=ids[:, :20], use_cache=True)
    ref, cache = [out.logits], out.cache
    logits, state = _logits(ours, ids[:, :20], None, ours.empty_state(1))
    got = [logits]
    for t in range(20, 30):
        out = hf(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
        ref.append(out.logits)
        cache = out.cache
        logits, state = _logits(ours, ids[:, t : t + 1], None, state)
        got.append(logits)
    assert (torch.cat(got, 1) - torch.cat(ref, 1)).abs().max() <= 1e-4


def test_left_padding_is_refused(checkpoint):
    _, path = checkpoint
    ours = load_hybrid_checkpoint(path)
    ids, mask = _batch()
    with pytest.raises(ValueError, match="right-padded"):
        ours(ids, mask.flip(-1))


def test_layer_types_from_the_interval():
    raw = json.loads(transformers.Qwen3NextConfig(**TINY).to_json_string())
    raw.pop("layer_types")
    for interval, expected in [(2, [LINEAR, FULL] * 2), (4, [LINEAR] * 3 + [FULL])]:
        assert HybridConfig.from_dict(raw | {"full_attention_interval": interval}).layer_types == (
            expected
        )
    assert HybridConfig.from_dict(raw).layer_types == [LINEAR] * 3 + [FULL]  # default 4
    with pytest.raises(CheckpointError, match="layer_types"):
        HybridConfig.from_dict(raw | {"layer_types": [LINEAR, "sliding_attention"] * 2})
    with pytest.raises(CheckpointError, match="not a qwen3_next"):
        HybridConfig.from_dict(raw | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "x"})
    with pytest.raises(CheckpointError, match="quantized"):
        HybridConfig.from_dict(raw | {"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(CheckpointError, match="partial_rotary_factor"):
        HybridConfig.from_dict(raw | {"rope_parameters": {"partial_rotary_factor": 0.1}})


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("written")
    hf_hybrid_model(**CASES["interval-4"]).save_pretrained(path)
    load_hybrid_checkpoint(path)  # loads as written
    return path


def _edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("A_log", lambda t: t.pop("model.layers.0.linear_attn.A_log"), "missing tensor"),
        (
            "conv",
            lambda t: t.update({"model.layers.2.linear_attn.conv1d.weight": torch.zeros(96, 1, 3)}),
            r"conv1d.weight: shape \(96, 1, 3\), expected \(96, 1, 4\)",
        ),
        ("expert", lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"), "missing"),
        (
            "shared",
            lambda t: t.pop("model.layers.1.mlp.shared_expert.up_proj.weight"),
            "missing tensor 'model.layers.1.mlp.shared_expert.up_proj.weight'",
        ),
        (
            "gate",
            lambda t: t.update({"model.layers.3.self_attn.q_proj.weight": torch.zeros(64, 64)}),
            r"qkv_proj.weight: shape",
        ),
    ],
)
def test_malformed_checkpoint_is_refused(tmp_path, written, name, edit, message):
    shutil.copytree(written, tmp_path, dirs_exist_ok=True)
    _edit_tensors(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_hybrid_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_hybrid_checkpoint(tmp_path / "missing")
