"""FP4 checkpoints against the unquantized model in our engine, side by side in one run.

On the common benchmark shape (`bench-moe-43m.json`, random weights), the fp32 checkpoint
and its `tierserve quantize` copies (MXFP4 and NVFP4 experts; NVFP4 on every linear layer)
are served by the same engine on CPU: greedy, prompts of 64-256 tokens, 128 new tokens,
1/4/16 concurrent requests. Prints the resident weight memory of each model and its decode
tokens/s (tokens generated once every request has its first token, over that time).

    python loadtests/bench_fp4_engine.py [--concurrency 1 4 16] [--new-tokens 128]
"""

import argparse
import time
from pathlib import Path

import torch
from bench_engine import build_checkpoint, make_prompts

from serving.checkpoint import load_checkpoint
from serving.engine import EngineConfig, LLMEngine
from serving.quantization import quantize_checkpoint
from serving.sampling_params import SamplingParams

VARIANTS = {  # name: (format, all_linear), None for the unquantized checkpoint
    "fp32": None,
    "mxfp4 experts": ("mxfp4", False),
    "nvfp4 experts": ("nvfp4", False),
    "nvfp4 all linear": ("nvfp4", True),
}


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
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(2)
    full = build_checkpoint(args.checkpoint)
    rows = []
    for name, variant in VARIANTS.items():
        path = full
        if variant is not None:
            path = full.with_name(f"{full.name}-{name.replace(' ', '-')}")
            if not (path / "model.safetensors").exists():
                quantize_checkpoint(full, path, *variant)
        model = load_checkpoint(path)
        vocab = model.config.vocab_size
        engine = LLMEngine(model, EngineConfig(max_num_seqs=64, max_num_batched_tokens=1024), [])
        decode_tokens_per_second(engine, make_prompts(2, vocab, seed=99), 8)  # warm up
        speeds = [
            decode_tokens_per_second(engine, make_prompts(c, vocab, seed=c), args.new_tokens)
            for c in args.concurrency
        ]
        rows.append((name, weight_bytes(model), speeds))
        print(f"{name}: {weight_bytes(model) / 2**20:.1f} MiB, decode tok/s {speeds}", flush=True)
    print(
        f"\n{full.name}: greedy, prompts of 64-256 tokens, {args.new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads; decode tok/s at "
        + "/".join(map(str, args.concurrency))
        + " concurrent requests"
    )
    head = " | ".join(f"{c} concurrent tok/s" for c in args.concurrency)
    print(f"| model | weight MiB | vs fp32 | {head} |")
    print("|---|---|---|" + "---|" * len(args.concurrency))
    base_bytes, base_speeds = rows[0][1], rows[0][2]
    for name, nbytes, speeds in rows:
        cells = " | ".join(
            f"{s:.0f} ({s / b:.2f}x)" for s, b in zip(speeds, base_speeds, strict=True)
        )
        print(f"| {name} | {nbytes / 2**20:.1f} | {nbytes / base_bytes:.2f}x | {cells} |")


if __name__ == "__main__":
    main()
