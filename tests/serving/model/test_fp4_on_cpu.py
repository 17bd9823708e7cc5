"""FP4 checkpoints served on a CPU with their weights kept FP4 (the C++ ops of
`kernels/cpu_fp4.py`): what they hold in memory, the tokens they serve against the same
checkpoint dequantized at load, eager and in compiled decode steps, and the checkpoints that
disagree with their config.json, refused before anything is served."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import cpu_extension, cpu_fp4
from kernels.modules import FP4Linear, QuantizedWeight
from serving.cli import main
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import load_checkpoint
from serving.model.config import CheckpointError
from serving.sampling.params import SamplingParams
from tests.tiny_models import TINY_MOE, prompts, save_tiny_moe

DEMO_HIGHSPEED = Path(__file__).parents[3] / "models" / "demo-highspeed"
EXPERT = "model.layers.1.mlp.experts.3"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[str, Path]:
    """The tiny MoE as MXFP4 experts and as NVFP4 on every linear layer."""
    full = save_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))
    out = {}
    for name, extra in (("mxfp4", []), ("nvfp4", ["--all-linear"])):
        out[name] = tmp_path_factory.mktemp(name)
        main(["quantize", "--model", str(full), "--format", name, "--out", str(out[name]), *extra])
    return out


def _greedy(model, prompts_: list[list[int]], tokens: int, **config) -> list:
    engine = LLMEngine(model, EngineConfig(**config), eos_token_ids=[])
    if engine.runner.paged.graphs:
        engine.runner.paged.graphs.wait()
        assert engine.runner.paged.graphs.ready_sizes == tuple(engine.runner.paged.graphs.sizes)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = engine.generate(prompts_, params)
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for [o] in outs]


def _assert_same(got: list, expected: list) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-4)


def test_the_cpu_keeps_fp4_weights_in_a_quarter_of_the_bytes(quantized):
    """Experts held as packed codes, 0.25x a bf16 copy's bytes, plus one scale byte a block
    (and NVFP4's fp32 scale a row); no widened copy anywhere in the model."""
    assert cpu_fp4.available()
    for name, path in quantized.items():
        model = load_checkpoint(path)
        experts = model.layers[0].mlp.gate_up
        assert isinstance(experts, QuantizedWeight)
        assert isinstance(model.layers[0].self_attn.qkv_proj, FP4Linear) == (name == "nvfp4")
        numel, rows = experts.shape.numel(), experts.shape[:-1].numel()
        assert experts.packed.nbytes == numel * 2 // 4
        row_scales = 4 * rows if name == "nvfp4" else 0
        assert (
            experts.tensor.nbytes() == numel // 2 + numel // experts.tensor.block_size + row_scales
        )
        assert not any(p.dtype.is_floating_point and p.dim() == 3 for p in model.parameters())


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("eager", [True, False])
def test_fp4_kept_serves_the_tokens_of_fp4_dequantized_at_load(quantized, fmt, eager):
    """The ops decode the very weights dequantization gives, so greedy tokens are the same
    and logprobs agree to the fp32 sums' order; batches of 1-4 sequences."""
    ps = prompts(4, TINY_MOE["vocab_size"], seed=11)
    config = {"max_num_seqs": 4, "enforce_eager": eager}
    kept = _greedy(load_checkpoint(quantized[fmt]), ps, 12, **config)
    dequantized = _greedy(load_checkpoint(quantized[fmt], keep_fp4=False), ps, 12, **config)
    _assert_same(kept, dequantized)


def test_the_demo_highspeed_model_decodes_the_same_kept_fp4(tmp_path):
    """The shipped NVFP4 model (bf16 rest) in fp32, compiled one-row decode steps (the tiny
    model's test above takes batches of several), its experts kept FP4: the greedy tokens of
    its weights dequantized at load. (Dequantized to bf16 they would be rounded: an E2M1
    value times an E4M3 scale fits bf16, times the tensor scale it does not.)"""
    ps = [[5, 17, 99, 230, 41, 7, 12, 300], [64, 3, 1000, 77]]
    config = {"max_num_seqs": 1, "enforce_eager": False}
    kept = load_checkpoint(DEMO_HIGHSPEED, "float32")
    assert isinstance(kept.layers[0].mlp.gate_up, QuantizedWeight)
    dequantized = load_checkpoint(DEMO_HIGHSPEED, "float32", keep_fp4=False)
    _assert_same(_greedy(kept, ps, 24, **config), _greedy(dequantized, ps, 24, **config))


def _corrupt(src: Path, dst: Path, tensors=None, config=None) -> Path:
    """A copy of `src` with some tensors replaced and some config.json fields changed."""
    shutil.copytree(src, dst)
    if tensors:
        hf = load_file(src / "model.safetensors")
        changed = {k: v.contiguous() for k, v in tensors(hf).items()}
        save_file(hf | changed, dst / "model.safetensors")
    if config:
        raw = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(raw | config))
    return dst


def _bad_checkpoints(quantized: dict[str, Path], tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name: (checkpoint, what the refusal says)."""
    mx, nv = quantized["mxfp4"], quantized["nvfp4"]
    scale, packed = f"{EXPERT}.gate_proj.weight_scale", f"{EXPERT}.gate_proj.weight_packed"
    return {
        "scales": (
            _corrupt(mx, tmp_path / "scales", tensors=lambda hf: {scale: hf[scale][:, :1]}),
            rf"{scale}: shape \(32, 1\), but config.json's 32 x 64 mxfp4 weight needs \(32, 2\)",
        ),
        "packed": (
            _corrupt(nv, tmp_path / "packed", tensors=lambda hf: {packed: hf[packed][:16]}),
            rf"{packed}: shape \(16, 32\), but config.json's 32 x 64 nvfp4 weight needs \(32, 32\)",
        ),
        "config": (
            _corrupt(mx, tmp_path / "config", config={"moe_intermediate_size": 64}),
            r"weight_packed: shape \(\d+, \d+\), but config.json's \d+ x \d+ mxfp4 weight",
        ),
        "global scale": (
            _corrupt(
                nv,
                tmp_path / "global",
                tensors=lambda hf: {
                    k: v.repeat(2) for k, v in hf.items() if k.endswith("weight_global_scale")
                },
            ),
            r"weight_global_scale: shape \(2,\)",
        ),
    }


def test_checkpoints_that_disagree_with_config_json_are_refused(quantized, tmp_path, capsys):
    """At load, and by `tierserve engine` with one line and exit status 2."""
    for name, (path, message) in _bad_checkpoints(quantized, tmp_path).items():
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(path)
        with pytest.raises(SystemExit) as e:
            main(["engine", "--model", str(path), "--port", "0"])
        err = capsys.readouterr().err
        assert e.value.code == 2, name
        assert err.startswith("tierserve: error:") and err.count("\n") == 1, err
        assert "shape" in err


def test_serve_refuses_them_before_starting_a_tier(quantized, tmp_path, capsys):
    """`tierserve serve` reads the safetensors headers before it starts anything."""
    path, message = _bad_checkpoints(quantized, tmp_path)["packed"]
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"tiers:\n  full: {{model: {quantized['mxfp4']}}}\n"
        f"  highspeed: {{model: {path}, served_model_name: fast}}\n"
    )
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", str(config)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "tiers.highspeed:" in err and re.search(message, err)


def test_nan_scales_are_refused(quantized, tmp_path):
    scale = f"{EXPERT}.up_proj.weight_scale"

    def nan(hf):
        bad = hf[scale].clone()
        bad[0, 0] = 255
        return {scale: bad}

    with pytest.raises(CheckpointError, match=f"{scale}: NaN block scales"):
        load_checkpoint(_corrupt(quantized["mxfp4"], tmp_path / "nan", tensors=nan))


def test_where_the_ops_cannot_be_built_one_warning_says_fp4_is_dequantized(
    quantized, monkeypatch, caplog
):
    """No C++ compiler: one warning naming what runs instead, and the checkpoint is loaded
    dequantized (plain weights), never served through a half-built op."""
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: not found")

    monkeypatch.setattr(cpu_extension, "built", cpu_extension.once(cpu_extension.load))
    monkeypatch.setattr(cpu_fp4, "available", cpu_extension.built_once(cpu_fp4.LIBRARY))
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    model = load_checkpoint(quantized["mxfp4"])
    assert not any(isinstance(m, (FP4Linear, QuantizedWeight)) for m in model.modules())
    assert model.config.quantization is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "ops.cpp) could not be built" in warnings[0]
    assert "dequantized at load" in warnings[0]
