"""Rollout throughput: sampling G answers to each of B task prompts with our engine (what the
DPO and RL stages do) against transformers `generate` at the same batch, side by side.

Both sample at temperature 1 with no filters and produce exactly `--max-tokens` tokens per
answer (EOS ignored), so the figures count the same work: B * G * max_tokens tokens over the
wall time, prefill included. Ours gets one request per prompt with n = G, as the rollouts
send them (the prompt is prefilled once, its KV blocks shared by the G answers), each sampled
token's logprob returned as the trainer needs it; transformers computes none and gets the B
prompts left-padded with `num_return_sequences=G`.

Each side runs `--repeats` times, alternating, and the median ratio is the figure (one run
of each on a busy 2-core machine ranged 2.5-3.4x); transformers runs in a fresh process each
time (see `theirs`).

    python loadtests/bench_rollouts.py [--model models/demo-full] [--prompts 8] [--group 8]
"""

import argparse
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.sampling.params import SamplingParams
from tasks import DEFAULT_DOMAINS, DOMAINS
from tasks.seeds import train_seed


def prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    """First turns of training tasks, across the domains, as the chat template renders them."""
    domains = [DOMAINS[name] for name in DEFAULT_DOMAINS]
    out = []
    for i in range(n):
        task = domains[i % len(domains)].generate(train_seed(i), 1)
        messages = [{"role": "user", "content": task.prompt}]
        text = engine.tokenizer.apply_chat_template(messages, tools=task.tools)
        out.append(engine.tokenizer.encode(text))
    return out


def ours(engine: LLMEngine, batch: list[list[int]], group: int, max_tokens: int) -> float:
    start = time.perf_counter()
    for i, ids in enumerate(batch):
        params = SamplingParams(
            n=group, max_tokens=max_tokens, ignore_eos=True, seed=i * group, logprobs=0
        )
        engine.add_request(f"r{i}", ids, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def theirs(
    model_dir: Path, batch: list[list[int]], group: int, max_tokens: int, pad: int, threads: int
) -> float:
    """transformers `generate`, timed in a process of its own, a fresh one each run: after two
    of its runs in the engine's process our engine ran a third slower (4600 against 3000
    tokens/s on two threads), so one shared process measured what each left the other."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(_generate, model_dir, batch, group, max_tokens, pad, threads).result()


def _generate(
    model_dir: Path, batch: list[list[int]], group: int, max_tokens: int, pad: int, threads: int
) -> float:
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()  # its load report: our MTP layer is unknown to it
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    width = max(len(ids) for ids in batch)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            num_return_sequences=group,
            pad_token_id=pad,
        )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/demo-full"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternating")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # fp32, as the rollouts' copy of the training weights and transformers here
    engine = LLMEngine.from_checkpoint(args.model, EngineConfig(max_num_seqs=128, dtype="float32"))
    batch = prompts(engine, args.prompts)
    pad = engine.model.config.pad_token_id or 0
    tokens = args.prompts * args.group * args.max_tokens
    ours(engine, batch[:1], 2, 4)  # warm-up
    print(
        f"{args.prompts} prompts x {args.group} samples x {args.max_tokens} tokens, "
        f"temperature 1, fp32, {args.threads} threads"
    )
    print(
        "| run | transformers s | tok/s | tierserve s | tok/s | ratio |\n|---|---|---|---|---|---|"
    )
    ratios = []
    for run in tqdm(range(1, args.repeats + 1), desc="runs", leave=False):
        t_ours = ours(engine, batch, args.group, args.max_tokens)
        t_theirs = theirs(args.model, batch, args.group, args.max_tokens, pad, args.threads)
        ratios.append(t_theirs / t_ours)
        tqdm.write(
            f"| {run} | {t_theirs:.1f} | {tokens / t_theirs:.0f} | {t_ours:.1f} | "
            f"{tokens / t_ours:.0f} | {ratios[-1]:.2f}x |"
        )
    print(
        f"tierserve / transformers: median {statistics.median(ratios):.2f}x "
        f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x) over {args.repeats} runs"
    )


if __name__ == "__main__":
    main()
