"""The `mtp` stage: an FP4 target's MTP head trained alone on the target's own outputs; the
export changes the head's tensors only, so the served main model is the one given."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from serving.model.causal_lm import CausalLM, causal_mask
from serving.model.checkpoint import load_checkpoint, quantize_checkpoint, read_safetensors
from serving.model.config import ModelConfig
from training.config import ConfigError
from training.stages.init_checkpoint import DEFAULT_SHAPE, init_checkpoint
from training.stages.mtp import load_for_mtp


def test_depths_past_the_layers_chain_the_last_one() -> None:
    """Depth 2 of a one-layer head: the layer again, on its own depth-1 output and the
    embedding of the token after the next, as serving chains drafts."""
    torch.manual_seed(0)
    config = ModelConfig.from_dict(DEFAULT_SHAPE | {"tierserve_mtp": {"num_layers": 1}})
    model = CausalLM(config).eval()
    model.init_weights()
    ids = torch.randint(0, config.vocab_size, (2, 10))
    positions = torch.arange(10).expand(2, 10)
    with torch.no_grad():
        hidden = model(ids, positions)
        one, two = model.mtp_logits(hidden, ids, positions, depths=2)
        assert torch.equal(one, model.mtp_logits(hidden, ids, positions)[0])
        rope, mask = model.rotary(positions, hidden.dtype), causal_mask(10, None, ids.device)
        layer, h = model.mtp[0], hidden
        for d in (1, 2):
            shifted = torch.zeros_like(ids)
            shifted[:, :-d] = ids[:, d:]
            h = layer(h, model.embed_tokens(shifted), rope, None, mask)
        assert torch.equal(two, model.compute_logits(h))


def test_a_model_without_a_head_is_refused(random_checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="no MTP head"):
        load_for_mtp(str(random_checkpoint))


@pytest.mark.slow
def test_the_head_learns_the_targets_outputs_and_nothing_else_changes(tmp_path: Path) -> None:
    shape = DEFAULT_SHAPE | {"tierserve_mtp": {"num_layers": 1}}
    dense = init_checkpoint(tmp_path / "dense", shape)
    target = tmp_path / "target"
    quantize_checkpoint(dense, target, "nvfp4", all_linear=False)
    assert len(load_for_mtp(str(target)).mtp) == 1
    out = tmp_path / "run"
    sets = ['draft_data="target"', "mtp_depths=2", "data.examples=8", "data.difficulties=[1]"]
    sets += ["train.steps=8", "train.micro_batch=4", "train.seq_len=512", "train.eval_every=0"]
    sets += ["train.optim.lr=1e-2", "train.optim.warmup_steps=0", "train.optim.min_lr_ratio=1.0"]
    cmd = [sys.executable, "-c", "from serving.cli import main; main()", "train", "mtp"]
    cmd += ["--init", str(target), "--style", "short", "--out", str(out)]
    cmd += [f"--set={s}" for s in sets]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)

    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"]
    assert all(0.0 <= log[-1][f"mtp_top1/{d}"] <= 1.0 for d in (1, 2))
    assert (out / "data" / "sft-short-target.jsonl").exists()
    given = read_safetensors(target)
    trained = read_safetensors(out / "model")
    assert set(trained) == set(given)
    changed = {k for k in given if not torch.equal(given[k], trained[k])}
    assert changed and all(k.startswith("mtp.") for k in changed)
    main = (target / "model.safetensors").read_bytes()
    assert (out / "model" / "model.safetensors").read_bytes() == main  # the model as it was
    assert not any(k.startswith("mtp.") for k in load_file(out / "model" / "model.safetensors"))
    assert any(k.endswith(".weight_packed") for k in changed)  # the head's experts, in FP4
    assert (out / "model" / "config.json").read_text() == (target / "config.json").read_text()
    load_checkpoint(out / "model")  # serves
