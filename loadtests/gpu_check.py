"""The serving path on a CUDA GPU, checked and measured in one go; prints one markdown table.

1. Kernel tests (`tests/kernels`) on the device, bf16 included.
2. Equivalence: greedy tokens of our engine on CUDA in bf16 (CUDA graphs on, and eager) against
   transformers' `generate` on CUDA in bf16, on the oracle prompts of
   `tests/serving/engine/test_engine_equivalence.py` (tiny random MoE) and on chat prompts
   through `models/demo-full`.
3. The Triton W4A16 GEMV (MXFP4, W 8192 x 8192) against bf16 `F.linear` at M = 1..16, with
   the bytes it reads per second as a share of the device's peak memory bandwidth.
4. The fused MoE over MXFP4 experts (a Qwen3-30B-A3B layer: 128 experts, hidden 2048,
   intermediate 768, top-8) against dequantize-then-bf16, and its time against the bf16
   experts in the same Triton kernel and in PyTorch.
5. The engine's decode tokens/s at 1, 16 and 64 streams, bf16 against MXFP4 experts, on a
   Qwen3-30B-A3B-shaped model cut to `--layers` layers (random weights, built on the device).

Times are medians of `triton.testing.do_bench`, which flushes the L2 cache between calls.
`loadtests/gpu_check.sh` runs it; without CUDA it exits with status 2 (under
TRITON_INTERPRET=1 on a CPU, `--smoke` runs every step on tiny shapes to check the script
itself; its figures mean nothing).

    python loadtests/gpu_check.py [--layers 16] [--peak-gbs GB/s]
"""

import argparse
import gc
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.formats import dequantize, quantize_mxfp4
from kernels.modules import QuantizedWeight
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.causal_lm import CausalLM
from serving.model.checkpoint import load_checkpoint
from serving.model.config import ModelConfig
from serving.model.moe import SparseMoE, grouped_experts, route
from serving.model.tokenizer import Tokenizer
from serving.sampling.params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
# HBM bandwidth from the vendors' data sheets (bytes/s), matched against the device name.
PEAK_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "B200": 8.0e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100": 1.555e12,
    "L40S": 0.864e12,
    "RTX 4090": 1.008e12,
}
CHAT_PROMPTS = [
    "What is 17 * 23?",
    "Write a Python function that reverses a string.",
    "List the files in /tmp, largest first.",
    "Call the weather tool for Paris.",
]
Row = tuple[str, str, str, str]  # check, setting, result, target (met or not)


def bench_us(fn, smoke: bool) -> float:
    if smoke:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def peak_bandwidth(override_gbs: float | None, device: torch.device) -> tuple[float, str]:
    if override_gbs:
        return override_gbs * 1e9, f"{override_gbs:.0f} GB/s (given)"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for key, peak in PEAK_BANDWIDTH.items():
        if key in name:
            return peak, f"{name}: {peak / 1e9:.0f} GB/s (data sheet)"
    a = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    peak = 2 * a.nbytes / (bench_us(lambda: b.copy_(a), device.type != "cuda") * 1e-6)
    return peak, f"{name}: {peak / 1e9:.0f} GB/s (measured copy; no data sheet figure known)"


def kernel_tests() -> list[Row]:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "tests/kernels"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    summary = (result.stdout.strip().splitlines() or ["no output"])[-1]
    ok = "met" if result.returncode == 0 else "NOT met"
    return [("kernel tests on the device", "tests/kernels", summary, f"all pass: {ok}")]


def _quantized(t: torch.Tensor, device: torch.device):
    q = quantize_mxfp4(t)
    q.packed, q.scales = q.packed.to(device), q.scales.to(device)
    return q


def greedy_equivalence(device: torch.device, smoke: bool) -> list[Row]:
    """Our engine's greedy tokens (graphs, then eager) against transformers' on the device."""
    import tempfile

    import transformers

    from tests.tiny_models import TINY_MOE, prompts, save_tiny_moe

    tiny = save_tiny_moe(Path(tempfile.mkdtemp()) / "tiny-moe")
    # (name, checkpoint, prompts, new tokens, EOS ids: both stop there, as transformers does)
    cases = [("tiny MoE, oracle prompts", tiny, prompts(8, TINY_MOE["vocab_size"]), 40, [])]
    if not smoke:
        full = REPO / "models" / "demo-full"
        tok = Tokenizer.from_dir(full)
        chats = [
            tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]))
            for c in CHAT_PROMPTS
        ]
        cases.append(("models/demo-full, chat prompts", full, chats, 64, tok.eos_token_ids))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for name, path, ps, new, eos in cases:
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        ref = []
        for p in ps:
            with torch.no_grad():
                out = hf.generate(
                    torch.tensor([p], device=device), max_new_tokens=new, do_sample=False
                )
            ref.append(out[0, len(p) :].tolist())
        del hf
        for eager in (False, True):
            config = EngineConfig(kv_cache_bytes=1 << 30, enforce_eager=eager)
            engine = LLMEngine(load_checkpoint(path, dtype, device), config, eos_token_ids=eos)
            params = SamplingParams(max_tokens=new, temperature=0.0)
            got = [o[0].token_ids for o in engine.generate(ps, params)]
            same = sum(g == r for g, r in zip(got, ref, strict=True))
            mode = "eager" if eager else "CUDA graphs"
            target = "identical: " + ("met" if same == len(ps) else "NOT met")
            rows.append(
                (
                    f"greedy = transformers ({str(dtype).removeprefix('torch.')})",
                    f"{name}, {mode}",
                    f"{same}/{len(ps)}",
                    target,
                )
            )
            del engine
    return rows


def gemv(device: torch.device, peak: float, smoke: bool) -> list[Row]:
    from kernels.triton_gemm import w4a16_gemm

    n = k = 128 if smoke else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    w = torch.randn(n, k, device=device) * 0.02
    q = _quantized(w, device)
    wb = dequantize(q, dtype)
    rows = []
    for m in (1, 2) if smoke else range(1, 17):
        x = torch.randn(m, k, device=device, dtype=dtype)
        err = (w4a16_gemm(x, q).float() - F.linear(x, wb).float()).abs().max()
        scale = F.linear(x, wb).float().abs().max()
        t_bf16 = bench_us(lambda x=x: F.linear(x, wb), smoke)
        t_fp4 = bench_us(lambda x=x: w4a16_gemm(x, q), smoke)
        share = (q.nbytes() + x.nbytes) / (t_fp4 * 1e-6) / peak
        target = ""
        if m == 1:
            met = share >= 0.6 and t_bf16 / t_fp4 >= 2
            target = f">= 60% of peak, >= 2x bf16: {'met' if met else 'NOT met'}"
        rows.append(
            (
                "W4A16 GEMV vs bf16",
                f"M={m}, W {n}x{k} mxfp4",
                f"{t_fp4:.1f} us vs {t_bf16:.1f} us ({t_bf16 / t_fp4:.2f}x), {share:.0%} of peak,"
                f" max err {float(err / scale):.1e} of max",
                target,
            )
        )
    return rows


def fused_moe_rows(device: torch.device, smoke: bool) -> list[Row]:
    from kernels.triton_moe import fused_moe

    e, h, i, top_k = (8, 64, 32, 2) if smoke else (128, 2048, 768, 8)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gate_up = torch.randn(e, 2 * i, h, device=device) * 0.02
    down = torch.randn(e, h, i, device=device) * 0.02
    q_gu, q_d = _quantized(gate_up, device), _quantized(down, device)
    d_gu, d_d = dequantize(q_gu, dtype), dequantize(q_d, dtype)  # dequantize, then bf16
    rows = []
    for tokens in (1, 4) if smoke else (1, 16, 64):
        x = torch.randn(tokens, h, device=device, dtype=dtype)
        w, ids = route(torch.randn(tokens, e, device=device), top_k, True)
        ref = grouped_experts(x, w, ids, d_gu, d_d).float()
        err = (fused_moe(x, w, ids, q_gu, q_d).float() - ref).abs().max() / ref.abs().max()
        t_fp4 = bench_us(lambda x=x, w=w, ids=ids: fused_moe(x, w, ids, q_gu, q_d), smoke)
        t_plain = bench_us(lambda x=x, w=w, ids=ids: fused_moe(x, w, ids, d_gu, d_d), smoke)
        t_torch = bench_us(lambda x=x, w=w, ids=ids: grouped_experts(x, w, ids, d_gu, d_d), smoke)
        rows.append(
            (
                "fused MoE vs dequantize-then-bf16",
                f"{tokens} tokens, {e} experts top-{top_k}, H {h}, I {i}, mxfp4",
                f"max err {float(err):.1e} of max; FP4 {t_fp4:.0f} us, bf16 Triton "
                f"{t_plain:.0f} us, bf16 PyTorch {t_torch:.0f} us",
                "",
            )
        )
    return rows


def bench_model(layers: int, device: torch.device, fp4: bool, smoke: bool) -> CausalLM:
    """A Qwen3-30B-A3B-shaped MoE (vocab cut to 32K) with random weights, built on the
    device; with `fp4`, its experts quantized to MXFP4 in memory."""
    shape = dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=512 if smoke else 32768,
        hidden_size=64 if smoke else 2048,
        intermediate_size=128 if smoke else 6144,
        moe_intermediate_size=32 if smoke else 768,
        num_hidden_layers=layers,
        num_attention_heads=4 if smoke else 32,
        num_key_value_heads=2 if smoke else 4,
        head_dim=16 if smoke else 128,
        num_experts=8 if smoke else 128,
        num_experts_per_tok=2 if smoke else 8,
        norm_topk_prob=True,
        max_position_embeddings=2048,
        rope_theta=1e6,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(ModelConfig.from_dict(shape))
    model.init_weights()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model.to(dtype)
    if fp4:
        for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
            for name in ("gate_up", "down"):
                weight = getattr(moe, name).detach().float()
                delattr(moe, name)
                setattr(moe, name, QuantizedWeight(quantize_mxfp4(weight)))
    return model.eval()


def decode_rate(engine: LLMEngine, streams: int, new: int) -> float:
    """Decode tokens/s: the time of `new` tokens less that of the first (prefill)."""
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(streams)
    prompts = [torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(streams)]

    def run(tokens: int) -> float:
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    run(2)  # warm-up
    return streams * (new - 1) / (run(new) - run(1))


def engine_decode(layers: int, device: torch.device, smoke: bool) -> list[Row]:
    streams = (1, 4) if smoke else (1, 16, 64)
    new = 8 if smoke else 128
    rates: dict[tuple[str, str], float] = {}
    for fp4 in (False, True):
        name = "mxfp4 experts" if fp4 else "bf16"
        for eager in (False, True):
            model = bench_model(layers, device, fp4, smoke)
            kv_bytes = 64 << 20 if smoke else 8 << 30
            config = EngineConfig(max_num_seqs=max(streams), kv_cache_bytes=kv_bytes)
            config.enforce_eager = eager
            engine = LLMEngine(model, config, eos_token_ids=[])
            for s in streams[:1] if eager else streams:
                rates[name, f"{s} stream{'s' * (s > 1)}{', eager' * eager}"] = decode_rate(
                    engine, s, new
                )
            del engine, model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    rows = []
    for setting in dict.fromkeys(k for _, k in rates):
        bf16, fp4 = rates["bf16", setting], rates["mxfp4 experts", setting]
        target = ""
        if setting == "1 stream":
            target = f"FP4 >= 1.5x bf16: {'met' if fp4 >= 1.5 * bf16 else 'NOT met'}"
        rows.append(
            (
                f"engine decode tok/s ({layers} layers)",
                setting,
                f"bf16 {bf16:.0f}, FP4 {fp4:.0f} ({fp4 / bf16:.2f}x)",
                target,
            )
        )
    return rows


def kv_sizing(device: torch.device) -> list[Row]:
    """What --gpu-memory-utilization 0.9 gives the demo model's KV cache."""
    config = EngineConfig(enforce_eager=True)
    engine = LLMEngine.from_checkpoint(REPO / "models" / "demo-full", config)
    blocks = engine.blocks.num_blocks
    free, total = torch.cuda.mem_get_info(device)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    used = (total - free) / 2**30
    result = f"{blocks} blocks of 16 tokens; {used:.1f} of {total / 2**30:.0f} GiB in use"
    return [("--gpu-memory-utilization 0.9", "models/demo-full", result, "")]


def section(name: str, check, *args) -> list[Row]:
    """One check's rows; a check that breaks gives an error row, and the others still run."""
    try:
        return check(*args)
    except Exception as e:  # reported in the table and on stderr
        traceback.print_exc()
        message = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        return [(name, "", f"ERROR {message}", "NOT met")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=16, help="layers of the engine's model")
    ap.add_argument("--peak-gbs", type=float, help="the device's peak memory bandwidth, GB/s")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU (see above)")
    args = ap.parse_args()
    if torch.cuda.is_available():
        device, smoke = torch.device("cuda"), False
    elif args.smoke and os.environ.get("TRITON_INTERPRET") == "1":
        device, smoke = torch.device("cpu"), True
    else:
        print("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False)", file=sys.stderr)
        sys.exit(2)
    peak, peak_text = peak_bandwidth(args.peak_gbs, device)
    rows = []
    if not smoke:
        rows += section("kernel tests", kernel_tests)
        rows += section("KV cache sizing", kv_sizing, device)
    rows += section("greedy = transformers", greedy_equivalence, device, smoke)
    rows += section("W4A16 GEMV", gemv, device, peak, smoke)
    rows += section("fused MoE", fused_moe_rows, device, smoke)
    rows += section("engine decode", engine_decode, 2 if smoke else args.layers, device, smoke)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run)"
    print(f"\n{name}, torch {torch.__version__}; peak bandwidth {peak_text}\n")
    print("| check | setting | result | target |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
    sys.exit(1 if any("NOT met" in row[3] for row in rows) else 0)


if __name__ == "__main__":
    main()
