"""FP4 checkpoints against the unquantized model in our engine, side by side in one run.

On the common benchmark shape (`bench-moe-43m.json`, random weights) the engine serves, with
compiled decode steps as a tier does: the fp32 checkpoint in fp32 and, where the CPU has
native bf16, in bf16 (`--dtype bfloat16`); its bf16 copy as `--dtype auto` loads it (in
bf16 where the CPU has native bf16; elsewhere fp32 compute with the decoder weights held in
bf16 and widened as they are used: "bf16 held"); and its `tierserve quantize` copies, MXFP4
and NVFP4 experts, with the rest in bf16 (as the shipped highspeed model) or fp32. The FP4
copies run with their experts kept FP4 (the C++ ops of `kernels/cpu_fp4.py`, the default on
a CPU) and, for MXFP4, dequantized at load (`keep_fp4=False`). Greedy, prompts of 64-256
tokens, 128 new tokens, 1/4/16 concurrent requests. Prints each one's resident weight and
expert memory and its decode tokens/s (tokens generated once every request has its first
token, over that time), with ratios to fp32 and to bf16 held.

With `--model DIR` (a bf16 checkpoint, FP4 or not: models/demo-highspeed, models/demo-full)
it compares the ways that checkpoint can serve on this CPU instead: as `--dtype auto` loads
it, for an FP4 checkpoint also with its experts dequantized at load, and widened at load to
fp32 (`--dtype float32`, dequantized).

    python loadtests/bench_fp4_engine.py [--concurrency 1 4 16] [--new-tokens 128]
    python loadtests/bench_fp4_engine.py --model models/demo-highspeed --concurrency 1 4
"""

import argparse
import re
import tempfile
import time
from pathlib import Path

import torch
from bench_engine import build_checkpoint, make_prompts

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import load_checkpoint, quantize_checkpoint, save_checkpoint
from serving.model.config import ModelConfig
from serving.model.dtype import is_supported
from serving.sampling.params import SamplingParams

VARIANTS = {  # name: (format, rest dtype), (None, dtype) for an unquantized copy
    "fp32": (None, torch.float32),
    "bf16": (None, torch.bfloat16),
    "mxfp4 experts, fp32 rest": ("mxfp4", torch.float32),
    "mxfp4 experts, bf16 rest": ("mxfp4", torch.bfloat16),
    "nvfp4 experts, bf16 rest": ("nvfp4", torch.bfloat16),
}


# row: (checkpoint variant, --dtype, keep_fp4)
ROWS = {
    "fp32": ("fp32", "float32", None),
    "bf16 (--dtype bfloat16)": ("fp32", "bfloat16", None),
    "bf16 held (auto)": ("bf16", "auto", None),
    "mxfp4 experts kept FP4, fp32 rest": ("mxfp4 experts, fp32 rest", "float32", None),
    "mxfp4 experts kept FP4, bf16 held rest (auto)": ("mxfp4 experts, bf16 rest", "auto", None),
    "nvfp4 experts kept FP4, bf16 held rest (auto)": ("nvfp4 experts, bf16 rest", "auto", None),
    "mxfp4 experts dequantized at load (auto)": ("mxfp4 experts, bf16 rest", "auto", False),
}


def variant_checkpoints(full: Path) -> dict[str, Path]:
    """Each variant's checkpoint directory, written from `full` on first use into the
    system's temporary directory (never beside `full`, which may be a shipped model)."""
    cache = Path(tempfile.gettempdir()) / "tierserve-fp4-variants"
    paths = {}
    for name, (fmt, dtype) in VARIANTS.items():
        path = full
        if name != "fp32":
            path = cache / f"{full.name}-{name.replace(' ', '-').replace(',', '')}"
            if not (path / "model.safetensors").exists():
                if fmt is None:
                    save_checkpoint(load_checkpoint(full, dtype), path, tokenizer_dir=full)
                else:
                    quantize_checkpoint(full, path, fmt, all_linear=False, dtype=dtype)
        paths[name] = path
    return paths


def weight_bytes(model: torch.nn.Module, experts_only: bool = False) -> int:
    """Parameters and persistent buffers (FP4 codes and scales), each tensor counted once;
    with `experts_only` the expert weights alone."""
    state = model.state_dict()
    if experts_only:
        state = {k: v for k, v in state.items() if re.search(r"\.mlp\.(gate_up|down)\b", k)}
    tensors = {t.data_ptr(): t for t in state.values()}
    return sum(t.nbytes for t in tensors.values())


def decode_tokens_per_second(engine: LLMEngine, prompts: list[list[int]], new: int) -> float:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    tag = time.monotonic()
    for i, p in enumerate(prompts):
        engine.add_request(f"fp4-{tag}-{i}", p, params)
    started: set[str] = set()
    decoded, decode_start = 0, None
    while engine.has_unfinished():
        outs = engine.step()
        if decode_start is not None:
            decoded += sum(len(o.token_ids) for out in outs for o in out.outputs)
        started.update(out.request_id for out in outs)
        if decode_start is None and len(started) == len(prompts):
            decode_start = time.monotonic()
    return decoded / (time.monotonic() - decode_start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/tierserve-bench-moe-43m"))
    ap.add_argument("--model", type=Path, help="a bf16 checkpoint: auto against fp32, compiled")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    ap.add_argument(
        "--threads", type=int, default=2, help="CPU threads (1 is steadier on a busy machine)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    full = args.model or build_checkpoint(args.checkpoint)
    engines, nbytes, expert_bytes = {}, {}, {}
    if args.model:
        rows = {"fp32": (full, "float32", False), "auto": (full, "auto", None)}
        if ModelConfig.from_file(full / "config.json").quantization is not None:
            rows["auto, FP4 dequantized at load"] = (full, "auto", False)
    else:
        paths = variant_checkpoints(full)
        rows = {name: (paths[variant], *how) for name, (variant, *how) in ROWS.items()}
        if not is_supported(torch.bfloat16):  # --dtype bfloat16 is refused without native bf16
            del rows["bf16 (--dtype bfloat16)"]
    for name, (path, dtype, keep_fp4) in rows.items():
        model = load_checkpoint(path, dtype, keep_fp4=keep_fp4)
        nbytes[name] = weight_bytes(model)
        expert_bytes[name] = weight_bytes(model, experts_only=True)
        # Compiled decode steps for every concurrency measured, as a tier serves.
        config = EngineConfig(
            max_num_seqs=max(args.concurrency), max_num_batched_tokens=1024, enforce_eager=False
        )
        engines[name] = LLMEngine(model, config, [])
        if engines[name].runner.paged.graphs:
            engines[name].runner.paged.graphs.wait()
    vocab = engines["fp32"].runner.model.config.vocab_size
    for engine in engines.values():
        decode_tokens_per_second(engine, make_prompts(2, vocab, seed=99), 8)  # warm up
    # Variants take turns within each repeat, so a busy spell on the machine hits all alike.
    speeds = {name: [0.0] * len(args.concurrency) for name in engines}
    for j, c in enumerate(args.concurrency):
        prompts = make_prompts(c, vocab, seed=c)
        for _ in range(args.repeats):
            for name, engine in engines.items():
                tps = decode_tokens_per_second(engine, prompts, args.new_tokens)
                speeds[name][j] = max(speeds[name][j], tps)
        print(
            f"{c} concurrent: " + ", ".join(f"{n} {s[j]:.0f}" for n, s in speeds.items()),
            flush=True,
        )
    print(
        f"\n{full.name}: greedy, prompts of 64-256 tokens, {args.new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads, best of {args.repeats}"
    )
    base = "bf16 held (auto)" if "bf16 held (auto)" in engines else "auto"
    print(f"(decode tok/s, x fp32, x {base})")
    head = " | ".join(f"{c} concurrent" for c in args.concurrency)
    print(f"| model | weight MiB | expert MiB (x fp32) | {head} |")
    print("|---|---|---|" + "---|" * len(args.concurrency))
    for name in engines:
        cells = " | ".join(
            f"{s:.0f} ({s / f:.2f}x, {s / b:.2f}x)"
            for s, f, b in zip(speeds[name], speeds["fp32"], speeds[base], strict=True)
        )
        ratio = expert_bytes[name] / expert_bytes["fp32"]
        print(
            f"| {name} | {nbytes[name] / 2**20:.1f} | {expert_bytes[name] / 2**20:.1f} "
            f"({ratio:.2f}x) | {cells} |"
        )


if __name__ == "__main__":
    main()
