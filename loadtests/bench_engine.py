"""Our engine against transformers `generate`, side by side in one run.

On the common benchmark shape (a random-weight Qwen3-MoE of 43.5M parameters, 10.5M active),
greedy decoding, prompts of 64-256 tokens, 128 new tokens, 1/4/16 concurrent requests:
transformers runs each group as one left-padded batch (its static batching), our engine as
concurrent requests under continuous batching, eager and with compiled decode steps
(`serving/model/graphs/decode.py`, compiled before timing), both in each `--dtypes` (fp32 and
bf16 by default). Prints output tokens/s (all generated tokens over the group's wall time,
prefill included) and mean time to first token, with ratios: ours against transformers in the
same dtype, compiled against eager, and our bf16 against our fp32.

    python loadtests/bench_engine.py [--concurrency 1 4 16] [--new-tokens 128] [--dtypes ...]
        [--threads 2]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import load_checkpoint
from serving.model.dtype import DTYPES
from serving.sampling.params import SamplingParams
from training.data.tokenizer import save_tokenizer, train_tokenizer
from training.stages.init_checkpoint import read_shape, stdlib_corpus

SHAPE = Path(__file__).with_name("bench-moe-43m.json")


def build_checkpoint(path: Path) -> Path:
    """The benchmark card's recipe: transformers, seed 0, an 8192-token byte-level BPE."""
    import transformers

    if (path / "model.safetensors").exists():
        return path
    shape = read_shape(SHAPE)
    shape.pop("architectures")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**shape))
    model.save_pretrained(path)
    save_tokenizer(train_tokenizer(stdlib_corpus(), shape["vocab_size"]), path)
    return path


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 257, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]


def run_ours(engine: LLMEngine, prompts: list[list[int]], new: int) -> tuple[float, float]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    start = time.monotonic()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{start}-{i}", p, params)
    first: dict[str, float] = {}
    generated = 0
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, out.first_token_time - start)
            generated += sum(len(o.token_ids) for o in out.outputs)
    wall = time.monotonic() - start
    return generated / wall, statistics.mean(first.values())


@torch.inference_mode()
def run_transformers(model, prompts: list[list[int]], new: int) -> tuple[float, float]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    start = time.monotonic()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    ttft = time.monotonic() - start
    start = time.monotonic()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    wall = time.monotonic() - start
    return (out.shape[1] - width) * len(prompts) / wall, ttft


def bench_dtype(path: Path, dtype: str, concurrency: list[int], new: int) -> list[dict]:
    """Both engines in one dtype, group by group, alternating."""
    import transformers

    torch_dtype = DTYPES[dtype]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    engines = {}
    for eager in (True, False):
        config = EngineConfig(max_num_seqs=32, max_num_batched_tokens=1024, enforce_eager=eager)
        engines[eager] = LLMEngine(load_checkpoint(path, torch_dtype), config, eos_token_ids=[])
    start = time.monotonic()
    engines[False].runner.paged.graphs.wait()
    print(f"{dtype}: decode steps compiled in {time.monotonic() - start:.1f} s")
    vocab = hf.config.vocab_size
    for engine in engines.values():  # warm up all three
        run_ours(engine, make_prompts(2, vocab, seed=99), 8)
    run_transformers(hf, make_prompts(2, vocab, seed=99), 8)
    rows = []
    for c in tqdm(concurrency, desc=dtype):
        prompts = make_prompts(c, vocab, seed=c)
        hf_tps, hf_ttft = run_transformers(hf, prompts, new)
        eager_tps, eager_ttft = run_ours(engines[True], prompts, new)
        our_tps, our_ttft = run_ours(engines[False], prompts, new)
        rows.append(
            dict(
                dtype=dtype,
                concurrency=c,
                hf_tps=hf_tps,
                eager_tps=eager_tps,
                our_tps=our_tps,
                hf_ttft=hf_ttft,
                eager_ttft=eager_ttft,
                our_ttft=our_ttft,
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/tierserve-bench-moe-43m"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["float32", "bfloat16"])
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument(
        "--threads", type=int, default=2, help="torch threads (1 on a machine shared with others)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = build_checkpoint(args.checkpoint)
    rows = [
        row
        for dtype in args.dtypes
        for row in bench_dtype(path, dtype, args.concurrency, args.new_tokens)
    ]
    print(
        f"\n{SHAPE.name}: greedy, prompts of 64-256 tokens, {args.new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        "| dtype | concurrent | transformers tok/s | tierserve eager tok/s "
        "| tierserve compiled tok/s | compiled / transformers | compiled / eager "
        "| TTFT transformers ms | TTFT eager ms | TTFT compiled ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['concurrency']} | {r['hf_tps']:.0f} | {r['eager_tps']:.0f} "
            f"| {r['our_tps']:.0f} | {r['our_tps'] / r['hf_tps']:.2f}x "
            f"| {r['our_tps'] / r['eager_tps']:.2f}x | {r['hf_ttft'] * 1e3:.0f} "
            f"| {r['eager_ttft'] * 1e3:.0f} | {r['our_ttft'] * 1e3:.0f} |"
        )
    ours = {(r["dtype"], r["concurrency"]): r["our_tps"] for r in rows}
    if {"float32", "bfloat16"} <= set(args.dtypes):
        print("\n| concurrent | tierserve compiled bf16 / fp32 |\n|---|---|")
        for c in args.concurrency:
            print(f"| {c} | {ours['bfloat16', c] / ours['float32', c]:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
