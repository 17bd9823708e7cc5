"""`--device`: resolving it, the KV cache it sizes, and every tensor of a step following the
model's device.

No GPU here, so the plumbing is checked on the CPU with torch's default device set to `meta`
while the engine runs: a tensor created without `device=` then lands on `meta`, and the first
op mixing it with the model's CPU tensors fails. A step that passes creates every tensor on
the model's device (or deliberately on the host), which is what running on CUDA needs.
"""

import subprocess
from pathlib import Path

import pytest
import torch

import serving.model.dtype as dtype_module
from serving.cli import build_parser, command_modules, main
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.gateway.config import GatewayConfig, GatewayConfigError, check_checkpoints
from serving.gateway.supervisor import engine_command
from serving.model.device import UnsupportedDeviceError, kv_cache_budget, resolve_device
from serving.model.dtype import UnsupportedDtypeError, resolve_dtype, resolve_kv_cache_dtype
from serving.sampling.params import SamplingParams
from speculative.config import SpeculativeConfig
from tests import REPO

TARGET = REPO / "models" / "demo-highspeed"  # has an MTP layer
DRAFT = REPO / "models" / "demo-draft"
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def test_auto_is_the_cpu_without_cuda_and_cuda_with_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(UnsupportedDeviceError, match=r"--device cuda: no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(UnsupportedDeviceError, match="not one of"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda") == torch.device("cuda")


def test_a_gpu_without_bfloat16_refuses_it_unless_auto_falls_back(monkeypatch, caplog):
    dtype_module._warn_fallback.cache_clear()  # it warns once a process
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    cuda = torch.device("cuda")
    with pytest.raises(UnsupportedDtypeError, match="this GPU has no native bfloat16"):
        resolve_dtype("bfloat16", "float32", cuda)
    assert resolve_dtype("float16", "bfloat16", cuda) == torch.float16
    assert resolve_dtype("auto", "bfloat16", cuda) == torch.float16  # vLLM's fallback
    assert "checkpoint is bfloat16" in caplog.text and "computing in float16" in caplog.text


def test_a_cpu_without_bfloat16_serves_a_bfloat16_checkpoint_in_float32(monkeypatch, caplog):
    """The shipped models are bf16; a CPU without AVX512-BF16 still serves them (`auto`)."""
    dtype_module._warn_fallback.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    with pytest.raises(UnsupportedDtypeError, match="this CPU has no native bfloat16"):
        resolve_dtype("bfloat16", "bfloat16")
    assert resolve_dtype("auto", "bfloat16") == torch.float32
    assert "computing in float32" in caplog.text
    engine = LLMEngine.from_checkpoint(TARGET, EngineConfig(dtype="auto"))
    assert engine.model.embed_tokens.weight.dtype == torch.float32


def test_a_cpu_without_bfloat16_still_stores_a_bfloat16_kv_cache(monkeypatch):
    """A cache dtype is storage, widened as attention reads it: greedy decoding of the
    trained full tier in fp32 over a bf16 cache picks the fp32 cache's tokens, with logprobs
    within bf16's rounding of the keys and values."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    with pytest.raises(UnsupportedDtypeError, match="not one of"):
        resolve_kv_cache_dtype("float8", torch.float32)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = {}
    for kv in ("float32", "bfloat16"):
        config = EngineConfig(dtype="float32", kv_cache_dtype=kv, enforce_eager=True)
        engine = LLMEngine.from_checkpoint(REPO / "models" / "demo-full", config)
        assert engine.runner.model.layers[0].self_attn.k_cache.dtype == getattr(torch, kv)
        prompt = engine.tokenizer.encode("<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n")
        [[outputs[kv]]] = engine.generate([prompt], params)
    assert outputs["bfloat16"].token_ids == outputs["float32"].token_ids
    fp32, bf16 = (
        torch.tensor([lp.logprob for lp in outputs[kv].logprobs]) for kv in ("float32", "bfloat16")
    )
    assert len(fp32) == 24
    torch.testing.assert_close(bf16, fp32, atol=0.05, rtol=0)


def test_the_kv_cache_gets_the_share_the_weights_leave(monkeypatch):
    """0.9 of 100 GiB with 10 GiB held by this process: 80 GiB, unless less is free."""
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (85 * gib, 100 * gib))
    assert kv_cache_budget(torch.device("cuda"), 0.9) == 80 * gib
    assert kv_cache_budget(torch.device("cuda"), 0.5) == 40 * gib
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 100 * gib))
    assert kv_cache_budget(torch.device("cuda"), 0.9) == 30 * gib  # another process holds the rest


@pytest.mark.parametrize("method", [None, "ngram", "mtp", "draft"])
def test_every_tensor_of_a_step_is_made_on_the_models_device(method):
    """Greedy with logprobs and prompt logprobs, seeded sampling with penalties and top-p, a
    JSON object constraint; plain and with each drafter (whose verification runs on sampled
    rows too). The outputs under the `meta` default equal those of a plain run."""
    spec = None
    if method is not None:
        draft = {"model": DRAFT} if method == "draft" else {}
        spec = SpeculativeConfig(method=method, disable_by_batch_size=None, **draft)
    config = EngineConfig(device="cpu", speculative=spec, max_model_len=256)
    engine = LLMEngine.from_checkpoint(TARGET, config)
    assert engine.runner.paged.device == torch.device("cpu")
    assert engine.runner.model.layers[0].self_attn.k_cache.device == torch.device("cpu")
    tok = engine.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        for text in ("What is 12 * 7?", "List the files in /tmp.", "Reply with a JSON object.")
    ]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, prompt_logprobs=1),
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, frequency_penalty=0.5),
        SamplingParams(max_tokens=12, temperature=0.0, json_object=True),
    ]
    expected = engine.generate(prompts, params)
    with torch.device("meta"):
        got = engine.generate(prompts, params)
    assert [[o.token_ids for o in outs] for outs in got] == [
        [o.token_ids for o in outs] for outs in expected
    ]
    engine.add_request("probe", prompts[0], params[1])
    assert engine.requests["probe"].seqs[0].generator.device == engine.runner.paged.device
    engine.abort("probe")


def test_generate_on_an_explicit_cpu(random_checkpoint: Path, capsys) -> None:
    # Eager: a compiled engine's background compilation would outlive the test.
    argv = ["generate", "--enforce-eager", "--model", str(random_checkpoint), "--max-tokens", "3"]
    main([*argv, "--device", "cpu", "def main():"])
    assert capsys.readouterr().out.strip()


@NO_CUDA
@pytest.mark.parametrize("command", ["generate", "engine"])
def test_cuda_without_a_gpu_is_one_line(random_checkpoint: Path, capsys, command) -> None:
    argv = [command, "--model", str(random_checkpoint), "--device", "cuda"]
    with pytest.raises(SystemExit) as e:
        main(argv + ["hi"] * (command == "generate"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--device cuda: no CUDA GPU" in err


def test_gpu_memory_utilization_must_be_a_fraction(random_checkpoint: Path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(random_checkpoint), "--gpu-memory-utilization", "0", "x"])
    assert e.value.code == 2 and "not in (0, 1]" in capsys.readouterr().err


def _tiers(model: Path, **full_options) -> GatewayConfig:
    """The full tier with `full_options`, the highspeed tier with the defaults."""
    full = {"model": str(model), **full_options}
    fast = {"model": str(model), "served_model_name": "fast"}
    return GatewayConfig.model_validate({"tiers": {"full": full, "highspeed": fast}})


def test_a_tiers_device_options_reach_its_engine(random_checkpoint: Path) -> None:
    options = {"device": "cpu", "gpu_memory_utilization": 0.45, "enforce_eager": True}
    config = _tiers(random_checkpoint, **options)
    check_checkpoints(config)
    command = engine_command(config.tiers.full, 8123)
    args = build_parser(command_modules()).parse_args(command[command.index("engine") :])
    assert (args.device, args.gpu_memory_utilization, args.enforce_eager) == ("cpu", 0.45, True)
    command = engine_command(config.tiers.highspeed, 8124)
    args = build_parser(command_modules()).parse_args(command[command.index("engine") :])
    assert (args.device, args.gpu_memory_utilization, args.enforce_eager) == ("auto", 0.9, False)


@NO_CUDA
def test_a_cuda_tier_without_a_gpu_is_a_config_error(random_checkpoint: Path) -> None:
    with pytest.raises(GatewayConfigError, match=r"tiers\.full: --device cuda: no CUDA GPU"):
        check_checkpoints(_tiers(random_checkpoint, device="cuda"))


@NO_CUDA
def test_gpu_check_without_a_gpu_says_so() -> None:
    result = subprocess.run(
        ["bash", str(REPO / "loadtests" / "gpu_check.sh")], capture_output=True, text=True
    )
    assert result.returncode == 2 and "no CUDA GPU" in result.stderr and not result.stdout
