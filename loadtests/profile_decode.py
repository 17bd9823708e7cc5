"""Where a decode step's time goes: `LLMEngine.step()` on the benchmark checkpoint under
torch.profiler, decode steps only (the prompts are prefilled first), compiled
(`serving/model/graphs/decode.py`, waited for) unless `--enforce-eager`.

Prints the mean step time and tokens/s at each concurrency, then the profiler's table of
operators by self CPU time, so per-step overhead (small ops, Python between them) shows.

    python -m loadtests.profile_decode [--concurrency 1 16] [--dtype float32] [--steps 32]
        [--enforce-eager]
"""

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from loadtests.bench_engine import build_checkpoint, make_prompts
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import load_checkpoint
from serving.model.dtype import DTYPES
from serving.sampling.params import SamplingParams


def decode_engine(path: Path, dtype: str, streams: int, steps: int, eager: bool) -> LLMEngine:
    """An engine with `streams` requests past their prefill and `steps` warm-up decodes,
    each with room for `2 * steps` more (timed, then profiled)."""
    engine = LLMEngine(
        load_checkpoint(path, DTYPES[dtype]),
        EngineConfig(max_num_seqs=32, max_num_batched_tokens=4096, enforce_eager=eager),
        eos_token_ids=[],
    )
    if not eager:
        engine.runner.paged.graphs.wait()
    params = SamplingParams(max_tokens=3 * steps + 8, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(streams, engine.model.config.vocab_size, seed=7)):
        engine.add_request(f"profile-{i}", prompt[:128], params)
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in running):
        engine.step()  # prefill
    for _ in range(steps):  # warm-up decodes
        engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/tierserve-bench-moe-43m"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--enforce-eager", action="store_true", help="profile eager steps")
    ap.add_argument("--rows", type=int, default=25, help="operators shown per table")
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = build_checkpoint(args.checkpoint)
    for streams in args.concurrency:
        engine = decode_engine(path, args.dtype, streams, args.steps, args.enforce_eager)
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step_ms = (time.perf_counter() - start) / args.steps * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                engine.step()
        ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
        mode = "eager" if args.enforce_eager else "compiled"
        print(
            f"\n## {streams} streams, {args.dtype}, {mode}: {step_ms:.2f} ms a decode step, "
            f"{streams / step_ms * 1e3:.0f} tok/s, {ops / args.steps:.0f} aten calls a step\n"
        )
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
