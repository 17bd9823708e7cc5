"""`tierserve quantize`: the compressed-tensors layout on disk, our loader, and the engine
serving the result."""

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kernels.formats import FP4Tensor, dequantize
from kernels.modules import FP4Linear, QuantizedWeight
from serving.api_server.api_server import build_app
from serving.cli import main
from serving.engine.async_engine import AsyncEngine
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import TOKENIZER_FILES, load_checkpoint, quantize_checkpoint
from serving.model.config import CheckpointError
from serving.model.quantization import quantize_state_dict
from serving.model.tokenizer import Tokenizer
from serving.sampling.params import SamplingParams
from tests.tiny_models import TINY_MOE, prompts, save_tiny_moe

FORMATS = ["mxfp4", "nvfp4"]


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    return save_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def quantized(full: Path, tmp_path_factory) -> dict[tuple[str, bool], Path]:
    out = {}
    for fmt in FORMATS:
        for all_linear in (False, True):
            path = tmp_path_factory.mktemp(f"{fmt}-{all_linear}")
            main(
                ["quantize", "--model", str(full), "--format", fmt, "--out", str(path)]
                + ["--all-linear"] * all_linear
            )
            out[fmt, all_linear] = path
    return out


def dequantized_copy(path: Path, out: Path) -> Path:
    """The FP4 checkpoint with every FP4 weight written back as the fp32 values its bytes
    hold, under plain names: the oracle for our FP4 model."""
    config = json.loads((path / "config.json").read_text())
    fmt = config.pop("quantization_config")["format"].split("-")[0]
    hf = load_file(path / "model.safetensors")
    plain = {k: v for k, v in hf.items() if ".weight_" not in k}
    for k in [k for k in hf if k.endswith(".weight_packed")]:
        base = k.removesuffix("_packed")
        gs = hf.get(f"{base}_global_scale")
        rows = hf[k].shape[0]
        t = FP4Tensor(
            fmt,
            hf[k],
            hf[f"{base}_scale"].view(torch.uint8),
            None if gs is None else (1 / gs).expand(rows),
            2 * hf[k].shape[1],
        )
        plain[base] = dequantize(t)
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(plain, out / "model.safetensors")
    for name in TOKENIZER_FILES:
        if (path / name).exists():
            shutil.copy(path / name, out / name)
    return out


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model.compute_logits(model(ids, positions))


@pytest.mark.parametrize("fmt", FORMATS)
def test_files_hold_the_compressed_tensors_layout(quantized, fmt):
    path = quantized[fmt, False]
    config = json.loads((path / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    assert q["format"] == f"{fmt}-pack-quantized"
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == (32 if fmt == "mxfp4" else 16)
    hf = load_file(path / "model.safetensors")
    e = "model.layers.1.mlp.experts.7"
    h, i = TINY_MOE["hidden_size"], TINY_MOE["moe_intermediate_size"]
    block = 32 if fmt == "mxfp4" else 16
    assert hf[f"{e}.gate_proj.weight_packed"].dtype == torch.uint8
    assert hf[f"{e}.gate_proj.weight_packed"].shape == (i, h // 2)
    assert hf[f"{e}.down_proj.weight_packed"].shape == (h, i // 2)
    scale_dtype = torch.uint8 if fmt == "mxfp4" else torch.float8_e4m3fn
    assert hf[f"{e}.down_proj.weight_scale"].dtype == scale_dtype
    assert hf[f"{e}.down_proj.weight_scale"].shape == (h, i // block)
    assert f"{e}.gate_proj.weight" not in hf
    assert hf["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router stays
    assert hf["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float32
    if fmt == "nvfp4":  # fused projections share the global scale, as vLLM wants
        gs = hf[f"{e}.gate_proj.weight_global_scale"]
        assert gs.shape == (1,) and torch.equal(gs, hf[f"{e}.up_proj.weight_global_scale"])
    else:
        assert f"{e}.gate_proj.weight_global_scale" not in hf


def test_all_linear_quantizes_attention_and_keeps_q_k_v_on_one_scale(quantized):
    hf = load_file(quantized["nvfp4", True] / "model.safetensors")
    a = "model.layers.0.self_attn"
    scales = [hf[f"{a}.{p}_proj.weight_global_scale"] for p in "qkv"]
    assert torch.equal(scales[0], scales[1]) and torch.equal(scales[0], scales[2])
    assert f"{a}.o_proj.weight_packed" in hf and "lm_head.weight" in hf
    model = load_checkpoint(quantized["nvfp4", True], keep_fp4=True)
    assert isinstance(model.layers[0].self_attn.qkv_proj, FP4Linear)
    assert isinstance(model.layers[0].mlp.gate_up, QuantizedWeight)
    assert isinstance(model.lm_head, torch.nn.Linear)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("all_linear", [False, True])
def test_fp4_model_computes_what_its_bytes_hold(quantized, tmp_path, fmt, all_linear):
    path = quantized[fmt, all_linear]
    ids = torch.tensor(prompts(3, TINY_MOE["vocab_size"], seed=5)[0])[None]
    ours = logits(load_checkpoint(path, keep_fp4=True), ids)
    oracle = logits(load_checkpoint(dequantized_copy(path, tmp_path / "plain")), ids)
    torch.testing.assert_close(ours, oracle, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("all_linear", [False, True])
def test_dequantizing_at_load_gives_the_same_weights(quantized, tmp_path, fmt, all_linear):
    """`keep_fp4=False` (and a CPU without the C++ FP4 ops) turns the FP4 weights into plain
    `dtype` weights once, at load: the bytes' exact values, no FP4 module left, and a config
    that no longer claims FP4 (so a save is plain)."""
    path = quantized[fmt, all_linear]
    plain = load_checkpoint(dequantized_copy(path, tmp_path / "plain")).state_dict()
    for dtype in (torch.float32, torch.bfloat16):
        model = load_checkpoint(path, dtype, keep_fp4=False)
        assert model.config.quantization is None
        assert not any(isinstance(m, (FP4Linear, QuantizedWeight)) for m in model.modules())
        state = model.state_dict()
        assert state.keys() == plain.keys()
        for k, v in plain.items():
            assert state[k].dtype == dtype and torch.equal(state[k], v.to(dtype)), k


@pytest.mark.parametrize("bf16_native", [False, True])
@pytest.mark.parametrize("all_linear", [False, True])
def test_auto_keeps_fp4_weights_fp4_on_a_cpu(
    quantized, tmp_path, monkeypatch, bf16_native, all_linear
):
    """A bf16 FP4 checkpoint under `auto` on a CPU keeps every FP4 weight FP4 (the C++ ops
    read them), whether or not the CPU computes bf16; the rest is in the compute dtype or
    held in bf16. Dequantized at load instead (`keep_fp4=False`), the FP4 weights are held in
    bf16 where `auto` computes in fp32, with the FP4 model's logits to bf16's precision."""
    path = tmp_path / "bf16-fp4"
    shutil.copytree(quantized["nvfp4", all_linear], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    monkeypatch.setattr(
        "serving.model.dtype.is_supported",
        lambda dtype, device=None: dtype == torch.float32 or bf16_native,
    )
    auto = load_checkpoint(path, "auto")
    compute = torch.bfloat16 if bf16_native else torch.float32
    assert auto.embed_tokens.weight.dtype == compute
    assert isinstance(auto.layers[0].mlp.gate_up, QuantizedWeight)
    assert isinstance(auto.layers[0].self_attn.qkv_proj, FP4Linear) == all_linear
    assert auto.config.quantization is not None
    if not bf16_native:
        dequantized = load_checkpoint(path, "auto", keep_fp4=False)
        assert dequantized.layers[0].mlp.gate_up.dtype == torch.bfloat16
        assert dequantized.config.quantization is None
        long_prompts = [p for p in prompts(20, TINY_MOE["vocab_size"], seed=8) if len(p) >= 16]
        ids = torch.tensor([p[:16] for p in long_prompts[:4]])
        held_bf16, fp4 = logits(dequantized, ids), logits(auto, ids)
        torch.testing.assert_close(held_bf16, fp4, atol=0.05, rtol=0.02)
        plain = load_checkpoint(path, "float32", keep_fp4=False)
        assert plain.layers[0].mlp.gate_up.dtype == torch.float32


def test_quality_against_full_precision(full, quantized):
    """On random weights: NVFP4 (finer blocks and scales) stays closer than MXFP4."""
    long_prompts = [p for p in prompts(20, TINY_MOE["vocab_size"], seed=6) if len(p) >= 24]
    ids = torch.tensor([p[:24] for p in long_prompts])
    ref = logits(load_checkpoint(full), ids).log_softmax(-1)
    kl = {}
    for fmt in FORMATS:
        got = logits(load_checkpoint(quantized[fmt, False]), ids).log_softmax(-1)
        kl[fmt] = F.kl_div(got, ref, log_target=True, reduction="none").sum(-1).mean().item()
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert top1 > 0.6, (fmt, top1)  # weights x8 make this tiny model chaotic
    assert 0 < kl["nvfp4"] < kl["mxfp4"] < 0.2, kl


def test_engine_serves_an_fp4_checkpoint_as_its_dequantized_twin(quantized, tmp_path):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ps = prompts(4, TINY_MOE["vocab_size"], seed=7)
    path = quantized["nvfp4", True]
    outs = {}
    for name, ckpt in (("fp4", path), ("plain", dequantized_copy(path, tmp_path / "plain"))):
        engine = LLMEngine(load_checkpoint(ckpt, keep_fp4=True), EngineConfig(), eos_token_ids=[])
        outs[name] = [o[0].token_ids for o in engine.generate(ps, greedy)]
    assert outs["fp4"] == outs["plain"]


def test_quantize_refuses_what_it_cannot_write(quantized, tmp_path, capsys):
    with pytest.raises(CheckpointError, match="multiple of 32"):
        w = {"model.layers.0.mlp.experts.0.down_proj.weight": torch.ones(4, 40)}
        quantize_state_dict(w, "mxfp4", all_linear=False)
    with pytest.raises(SystemExit) as e:
        main(
            [
                "quantize",
                "--model",
                str(quantized["mxfp4", False]),
                "--format",
                "nvfp4",
                "--out",
                str(tmp_path / "again"),
            ]
        )
    assert e.value.code == 2
    assert "already quantized" in capsys.readouterr().err
    awq = tmp_path / "awq"
    shutil.copytree(quantized["mxfp4", False], awq)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (awq / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported quantization 'awq'"):
        load_checkpoint(awq)


async def test_tier_server_answers_from_an_fp4_checkpoint(random_checkpoint, tmp_path):
    """`tierserve quantize` output served over the OpenAI API answers as its dequantized
    twin does (the random checkpoint with a real tokenizer and chat template)."""
    path = tmp_path / "fp4"
    main(["quantize", "--model", str(random_checkpoint), "--format", "mxfp4", "--out", str(path)])
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": "What is 17 * 23?"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    answers = []
    for ckpt in (path, dequantized_copy(path, tmp_path / "plain")):
        engine = AsyncEngine(LLMEngine.from_checkpoint(ckpt, EngineConfig(kv_cache_bytes=8 << 20)))
        try:
            app = build_app(engine, Tokenizer.from_dir(ckpt), "m")
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://tier") as client:
                response = await client.post("/v1/chat/completions", json=request)
        finally:
            engine.stop()
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0]["message"])
    assert answers[0]["content"] and answers[0] == answers[1]


@pytest.mark.usefixtures("any_dtype_native")  # `auto` keeps bf16 only where it is native
def test_quantize_stores_the_full_precision_rest_in_the_dtype_asked(full, quantized, tmp_path):
    """A QAT export quantizes from its fp32 latent but ships embeddings, norms and routers in
    bf16, like every shipped model; by default the source's dtype is kept."""
    assert json.loads((quantized["nvfp4", False] / "config.json").read_text())["dtype"] == "float32"
    out = tmp_path / "bf16-rest"
    quantize_checkpoint(full, out, "nvfp4", False, torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = load_file(out / "model.safetensors")
    assert hf["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert hf["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    packed = "model.layers.0.mlp.experts.0.down_proj.weight_packed"
    fp32_rest = load_file(quantized["nvfp4", False] / "model.safetensors")
    assert torch.equal(hf[packed], fp32_rest[packed])
    model = load_checkpoint(out, "auto")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
