"""FP4 checkpoints against the unquantized model in our engine, side by side in one run.

On the common benchmark shape (`bench-moe-43m.json`, random weights), the fp32 checkpoint
(in fp32 and in bf16) and its `tierserve quantize` copies (MXFP4 and NVFP4 experts; NVFP4 on
every linear layer) are served by the same engine on CPU: greedy, prompts of 64-256 tokens,
128 new tokens, 1/4/16 concurrent requests. The FP4 copies run two ways: with their FP4
modules kept (`keep_fp4=True`, dequantizing per step) and as the CPU loads them by default,
dequantized once at load to bf16. Prints the resident weight memory of each and its decode
tokens/s (tokens generated once every request has its first token, over that time).

With `--model DIR` (a bf16 checkpoint, FP4 or not: models/demo-highspeed, models/demo-full)
it compares the ways that checkpoint can serve on this CPU instead, compiled as a server runs
them: as `--dtype auto` loads it (in bf16 where the CPU has native bf16; where `auto` computes
in fp32, the decoder weights held in bf16 and widened as they are used), for an FP4 checkpoint
with its FP4 experts kept (dequantized per step), and widened at load to fp32 (`--dtype
float32`).

    python loadtests/bench_fp4_engine.py [--concurrency 1 4 16] [--new-tokens 128]
    python loadtests/bench_fp4_engine.py --model models/demo-highspeed --concurrency 1 4
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from bench_engine import build_checkpoint, make_prompts

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import load_checkpoint, quantize_checkpoint
from serving.model.config import ModelConfig
from serving.sampling.params import SamplingParams

VARIANTS = {  # name: (format, all_linear), None for the unquantized checkpoint
    "fp32": None,
    "mxfp4 experts": ("mxfp4", False),
    "nvfp4 experts": ("nvfp4", False),
    "nvfp4 all linear": ("nvfp4", True),
}


# row: (checkpoint variant, dtype, keep_fp4)
ROWS = {
    "fp32": ("fp32", torch.float32, None),
    "bf16": ("fp32", torch.bfloat16, None),
    "mxfp4 experts, FP4 per step": ("mxfp4 experts", torch.float32, True),
    "nvfp4 experts, FP4 per step": ("nvfp4 experts", torch.float32, True),
    "nvfp4 all linear, FP4 per step": ("nvfp4 all linear", torch.float32, True),
    "nvfp4 all linear, dequantized at load to bf16": ("nvfp4 all linear", torch.bfloat16, None),
}


def variant_checkpoints(full: Path) -> dict[str, Path]:
    """Each variant's checkpoint directory, quantized from `full` on first use into the
    system's temporary directory (never beside `full`, which may be a shipped model)."""
    cache = Path(tempfile.gettempdir()) / "tierserve-fp4-variants"
    paths = {}
    for name, variant in VARIANTS.items():
        path = full
        if variant is not None:
            path = cache / f"{full.name}-{name.replace(' ', '-')}"
            if not (path / "model.safetensors").exists():
                quantize_checkpoint(full, path, *variant)
        paths[name] = path
    return paths


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters and persistent buffers (FP4 codes and scales), each tensor counted once."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
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
    engines, nbytes = {}, {}
    if args.model:
        rows = {"fp32": (full, "float32", None), "auto": (full, "auto", None)}
        if ModelConfig.from_file(full / "config.json").quantization is not None:
            rows["auto, FP4 kept"] = (full, "auto", True)
    else:
        paths = variant_checkpoints(full)
        rows = {name: (paths[variant], *how) for name, (variant, *how) in ROWS.items()}
    for name, (path, dtype, keep_fp4) in rows.items():
        model = load_checkpoint(path, dtype, keep_fp4=keep_fp4)
        nbytes[name] = weight_bytes(model)
        config = EngineConfig(
            max_num_seqs=64, max_num_batched_tokens=1024, enforce_eager=not args.model
        )
        engines[name] = LLMEngine(model, config, [])
        if engines[name].runner.graphs:
            engines[name].runner.graphs.wait()
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
    head = " | ".join(f"decode tok/s, {c} concurrent" for c in args.concurrency)
    print(f"| model | weight MiB | vs fp32 | {head} |")
    print("|---|---|---|" + "---|" * len(args.concurrency))
    for name in engines:
        cells = " | ".join(
            f"{s:.0f} ({s / b:.2f}x)" for s, b in zip(speeds[name], speeds["fp32"], strict=True)
        )
        ratio = nbytes[name] / nbytes["fp32"]
        print(f"| {name} | {nbytes[name] / 2**20:.1f} | {ratio:.2f}x | {cells} |")


if __name__ == "__main__":
    main()
