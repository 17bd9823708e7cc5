"""Quantization-aware training: FP4 values forward, the identity backward, and a trained
model that `tierserve quantize`'s layout serves with exactly the weights it trained with."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.formats import dequantize, quantize_mxfp4, quantize_nvfp4
from serving.model.checkpoint import load_checkpoint, quantize_checkpoint
from serving.model.moe import SparseMoE
from training.stages.outputs import export
from training.stages.qat import FakeFP4, disable_qat, enable_qat, served_state_dict


@pytest.mark.parametrize("format", ["mxfp4", "nvfp4"])
def test_fake_quantization_rounds_forward_and_passes_gradients_straight(format) -> None:
    w = torch.randn(3, 8, 64, requires_grad=True)
    y = FakeFP4(format, per_matrix=True)(w)
    if format == "mxfp4":
        expected = dequantize(quantize_mxfp4(w.detach()))
    else:  # one tensor scale per matrix (expert)
        amax = w.detach().abs().amax(dim=(1, 2))[:, None]
        expected = dequantize(quantize_nvfp4(w.detach(), amax))
    assert torch.equal(y, expected)
    assert not torch.allclose(y, w)  # it did round
    g = torch.randn_like(w)
    y.backward(g)
    assert torch.equal(w.grad, g)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model.compute_logits(model(ids, positions))


@pytest.mark.parametrize(("format", "all_linear"), [("mxfp4", False), ("nvfp4", True)])
def test_the_quantized_export_serves_the_weights_training_saw(
    random_checkpoint: Path, tmp_path: Path, format, all_linear
) -> None:
    model = load_checkpoint(random_checkpoint)
    n = enable_qat(model, format, all_linear)
    layers = model.config.num_hidden_layers + len(model.mtp)
    assert n == layers * (4 if all_linear else 2)  # gate_up, down (+ qkv, o)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    trained = _logits(model, ids)
    plain = load_checkpoint(random_checkpoint)
    assert not torch.allclose(trained, _logits(plain, ids), atol=1e-3)  # QAT changes the forward
    snapshot = export(model, tmp_path / "snapshot", random_checkpoint, torch.float32)
    assert torch.allclose(_logits(load_checkpoint(snapshot), ids), trained, atol=1e-4)
    disable_qat(model)
    assert not any(".parametrizations." in k for k in served_state_dict(model))
    latent = export(model, tmp_path / "latent", random_checkpoint, torch.float32)
    quantize_checkpoint(latent, tmp_path / "fp4", format, all_linear)
    served = load_checkpoint(tmp_path / "fp4")
    assert any(isinstance(m, SparseMoE) for m in served.modules())
    assert torch.allclose(_logits(served, ids), trained, atol=1e-4)


@pytest.mark.slow
def test_an_sft_stage_with_qat_exports_an_fp4_checkpoint(
    random_checkpoint: Path, tmp_path: Path
) -> None:
    sets = [
        "data.examples=12",
        "train.steps=2",
        "train.micro_batch=2",
        "train.eval_n=1",
        "train.eval_max_tokens=8",
        "data.mix={math = 1.0}",
        'qat.format="nvfp4"',
    ]
    cmd = [sys.executable, "-c", "from serving.cli import main; main()", "train", "sft"]
    cmd += ["--init", str(random_checkpoint), "--out", str(tmp_path / "run")]
    cmd += [f"--set={s}" for s in sets]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    config = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert not (tmp_path / "run" / "model-latent").exists()
    load_checkpoint(tmp_path / "run" / "model")  # loads as the engine would


@pytest.mark.slow
def test_a_short_sft_stage_distils_from_a_think_teacher(
    random_checkpoint: Path, tmp_path: Path
) -> None:
    sets = ["data.examples=12", "train.steps=2", "train.micro_batch=2", "train.eval_n=1"]
    # Domains whose short answers leave the reasoning out: the teacher (the student's own
    # start here) reads it first, so the KL is positive from the first step. (A math row's
    # student learns the whole think turn, where the KL starts at 0.)
    sets += ["train.eval_max_tokens=8", "data.mix={code = 1.0, terminal = 1.0}"]
    sets += [f'teacher="{random_checkpoint}"', "kd_weight=0.5"]
    cmd = [sys.executable, "-c", "from serving.cli import main; main()", "train", "sft"]
    cmd += ["--init", str(random_checkpoint), "--style", "short", "--out", str(tmp_path / "run")]
    cmd += [f"--set={s}" for s in sets]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert all(row["kd_loss"] > 0 for row in log)
    load_checkpoint(tmp_path / "run" / "model")


def test_eval_quantization_prints_kl_and_agreement(random_checkpoint: Path, tmp_path) -> None:
    quantize_checkpoint(random_checkpoint, tmp_path / "mxfp4", "mxfp4", False)
    cmd = [sys.executable, "-c", "from serving.cli import main; main()", "eval", "quantization"]
    cmd += ["--full-precision", str(random_checkpoint), "--examples", "4"]
    cmd += ["--quantized", str(random_checkpoint), str(tmp_path / "mxfp4")]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(f"| {tmp_path}")]
    rows += [line.split(" | ") for line in out.splitlines() if "tiny-moe |" in line]
    (same,) = [r for r in rows if r[1] == "-"]
    (fp4,) = [r for r in rows if r[1] == "mxfp4"]
    assert float(same[3]) == 0.0 and same[4] == "100.0% |"  # the model against itself
    assert float(fp4[3]) > 0.0
    assert float(fp4[2]) < float(same[2])  # FP4 experts: a smaller file
