"""Our model against transformers on the same checkpoint (the reference implementation)."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from serving.model.causal_lm import CausalLM  # noqa: E402
from serving.model.checkpoint import (  # noqa: E402
    load_checkpoint,
    read_safetensors,
    save_checkpoint,
)
from serving.model.config import CheckpointError, ModelConfig  # noqa: E402

MOE = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=6,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
)


def _hf_model(kind: str, **over):
    torch.manual_seed(0)
    if kind == "moe":
        cfg = transformers.Qwen3MoeConfig(**(MOE | over))
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        keys = {k: v for k, v in MOE.items() if "expert" not in k and k != "moe_intermediate_size"}
        cfg = transformers.Qwen3Config(**(keys | over))
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # norms start at 1: perturb them so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _batch():
    torch.manual_seed(1)
    lengths = [11, 5, 17]
    ids = torch.zeros(3, 17, dtype=torch.long)
    mask = torch.zeros(3, 17, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(0, MOE["vocab_size"], (n,))
        mask[b, :n] = 1
    return ids, mask


def _ours_logits(model, ids, mask):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, padding_mask=mask.bool()))


def _assert_close_on_real_tokens(a, b, mask):
    diff = (a - b).abs()[mask.bool()]
    assert diff.max().item() <= 1e-4, diff.max().item()


CASES = [
    ("moe", {}),
    ("moe", {"norm_topk_prob": True, "mlp_only_layers": [1], "tie_word_embeddings": True}),
    ("moe", {"decoder_sparse_step": 2}),
    ("dense", {}),
    ("dense", {"tie_word_embeddings": True}),
]


@pytest.mark.parametrize(("kind", "over"), CASES)
def test_loader_matches_transformers(tmp_path, kind, over):
    hf = _hf_model(kind, **over)
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path)
    ids, mask = _batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    _assert_close_on_real_tokens(_ours_logits(ours, ids, mask), ref, mask)


@pytest.mark.parametrize(("kind", "over"), CASES[:2] + CASES[3:4])
def test_saver_output_loads_in_transformers(tmp_path, kind, over):
    hf = _hf_model(kind, **over)
    hf.save_pretrained(tmp_path / "a")
    ours = load_checkpoint(tmp_path / "a")
    save_checkpoint(ours, tmp_path / "b")
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
    ids, mask = _batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        got = auto(input_ids=ids, attention_mask=mask).logits
    _assert_close_on_real_tokens(got, ref, mask)
    assert type(auto).__name__ == type(hf).__name__


def test_refuses_unsupported_and_malformed(tmp_path):
    hf = _hf_model("moe")
    hf.save_pretrained(tmp_path)
    cfg = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(cfg.replace("Qwen3MoeForCausalLM", "LlamaForCausalLM"))
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(cfg)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "missing")


def test_mtp_tensors_round_trip_and_transformers_ignores_them(tmp_path):
    hf = _hf_model("moe")
    hf.save_pretrained(tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    cfg["tierserve_mtp"] = {"num_layers": 2}
    config = ModelConfig.from_dict(cfg)
    model = CausalLM(config)
    model.init_weights()
    save_checkpoint(model, tmp_path / "b")
    # The head apart, where transformers and vLLM do not look: the rest is plain Qwen3-MoE.
    names = safe_open(tmp_path / "b" / "mtp" / "model.safetensors", "pt").keys()
    assert "mtp.layers.1.eh_proj.weight" in names
    assert "mtp.layers.0.block.mlp.experts.3.up_proj.weight" in names
    main = safe_open(tmp_path / "b" / "model.safetensors", "pt").keys()
    assert not any(name.startswith("mtp.") for name in main)
    back = load_checkpoint(tmp_path / "b")
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # A checkpoint written with the head inside model.safetensors still loads.
    shutil.copytree(tmp_path / "b", tmp_path / "one-file")
    shutil.rmtree(tmp_path / "one-file" / "mtp")
    save_file(read_safetensors(tmp_path / "b"), tmp_path / "one-file" / "model.safetensors")
    older = load_checkpoint(tmp_path / "one-file")
    for (name, a), b in zip(model.state_dict().items(), older.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    ids, mask = _batch()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        hidden = back(ids, positions, padding_mask=mask.bool())
        mtp = back.mtp_logits(hidden, ids, positions, mask.bool())
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
        hf_logits = ref(input_ids=ids, attention_mask=mask).logits
    assert [t.shape for t in mtp] == [(3, 17, MOE["vocab_size"])] * 2
    _assert_close_on_real_tokens(back.compute_logits(hidden), hf_logits, mask)
