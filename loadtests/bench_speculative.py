"""Speculative decoding against plain decoding, side by side in one run.

Speculation only pays with drafters that agree with the target, so this runs the shipped
demo models (random-weight models such as the common benchmark shape would accept
nothing): the target (default `models/demo-full`) with each drafter: n-gram prompt lookup,
its own MTP layer, and `models/demo-draft`. Prompts are held-out tasks of the four domains
rendered by the chat template; greedy decoding, up to `--new-tokens` per request.
Requests run in groups of `concurrency` under continuous batching; output tokens/s is all
generated tokens over the wall time (prefill included), and beside it over the decode steps
alone (after every request of a group has its first token). Every speculative run is checked
token for token against the plain run. Methods alternate within each round, and the
median over rounds is reported, so slow periods of a noisy machine hit all alike.

    python loadtests/bench_speculative.py [--concurrency 1 4 16] [--new-tokens 128] [--k 4]
        [--enforce-eager] [--target DIR] [--mtp-head DIR] [--drafters ngram mtp draft]
"""

import argparse
import dataclasses
import itertools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.causal_lm import CausalLM
from serving.model.config import ModelConfig
from serving.model.moe import SparseMoE
from serving.model.spans import TokenSpan
from serving.model.tokenizer import Tokenizer
from serving.sampling.params import SamplingParams
from speculative.config import SpeculativeConfig
from speculative.mtp import MTPProposer
from tasks import DEFAULT_DOMAINS, DOMAINS, Task
from tasks.seeds import EVAL_SEED_BASE

MODELS = Path(__file__).resolve().parent.parent / "models"


def held_out_tasks(n: int) -> list[Task]:
    """n held-out tasks, domains and difficulties 1-3 in turn."""
    domains = [DOMAINS[name] for name in DEFAULT_DOMAINS]
    return [
        domains[i % len(domains)].generate(EVAL_SEED_BASE + i, 1 + i // len(domains) % 3)
        for i in range(n)
    ]


def task_prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    """`held_out_tasks` as chat prompts."""
    prompts = []
    for task in held_out_tasks(n):
        messages = [{"role": "user", "content": task.prompt}]
        text = tokenizer.apply_chat_template(messages, tools=task.tools)
        prompts.append(tokenizer.encode(text))
    return prompts


@dataclass
class Speed:
    outputs: list[list[int]]  # token ids per prompt
    overall: float  # output tokens/s over the wall time, prefill included
    decode: float  # over the decode steps alone


def run(engine: LLMEngine, prompts: list[list[int]], concurrency: int, new: int) -> Speed:
    """Prompts `concurrency` at a time. The decode steps are those after every request of a
    group has its first token: their figure leaves out the prefill and, for MTP, the
    drafter's catch-up over the prompt, which a long answer spreads over more tokens."""
    params = SamplingParams(max_tokens=new, temperature=0.0)
    outputs: list[list[int]] = []
    decode_seconds, decode_tokens = 0.0, 0
    start = time.monotonic()
    for i in range(0, len(prompts), concurrency):
        group: dict[str, list[int]] = {}
        for prompt in prompts[i : i + concurrency]:
            request_id = f"bench-{time.monotonic_ns()}-{len(group)}"
            group[request_id] = []
            engine.add_request(request_id, prompt, params)
        while engine.has_unfinished():
            decoding = all(group.values())
            step_start = time.monotonic()
            step = engine.step()
            if decoding:
                decode_seconds += time.monotonic() - step_start
            for out in step:
                for delta in out.outputs:
                    group[out.request_id] += delta.token_ids
                    decode_tokens += len(delta.token_ids) if decoding else 0
        engine.idle()
        outputs += group.values()
    elapsed = time.monotonic() - start
    return Speed(outputs, sum(map(len, outputs)) / elapsed, decode_tokens / decode_seconds)


def _ms(fn, calls: int = 200) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def module_bytes(module: torch.nn.Module) -> int:
    """A module's parameters and buffers (an FP4 weight's codes and scales), in bytes."""
    return sum(t.nbytes for t in itertools.chain(module.parameters(), module.buffers()))


@torch.inference_mode()
def weights_read(model: CausalLM, prompts: list[list[int]], sizes: list[int]) -> dict[int, float]:
    """The weight bytes a step of n consecutive tokens of one sequence must read, as a share of
    a one-token step's: each layer's dense weights once, and each expert once if any of the n
    tokens routes to it. A step bound by reading its weights costs at least this share, so
    it is the floor of the timed ratios beside it. The embedding and LM head are left out, as
    the timed steps leave them out. Routing is the model's own over `prompts`, averaged over
    every window of n tokens."""
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    experts = [module_bytes(m) - module_bytes(m.gate) for m in moes]  # each layer's, all of them
    dense = sum(module_bytes(layer) for layer in model.layers) - sum(experts)
    per_expert = [b / m.gate_up.shape[0] for b, m in zip(experts, moes, strict=True)]
    windows: dict[int, list[float]] = {n: [] for n in sizes}
    for ids in prompts:
        logits: list[torch.Tensor] = []
        tokens = torch.tensor([ids])
        model(tokens, torch.arange(len(ids))[None], padding_mask=tokens >= 0, router_logits=logits)
        chosen = [
            x.reshape(len(ids), -1).topk(k).indices.tolist()
            for x, k in zip(logits, [m.top_k for m in moes], strict=True)
        ]
        for n in sizes:
            for start in range(len(ids) - n + 1):
                distinct = [len({e for row in c[start : start + n] for e in row}) for c in chosen]
                read = sum(d * b for d, b in zip(distinct, per_expert, strict=True))
                windows[n].append(dense + read)
    mean = {n: statistics.mean(w) for n, w in windows.items()}
    return {n: mean[n] / mean[1] for n in sizes}


@torch.inference_mode()
def measure_costs(target: LLMEngine, draft: LLMEngine, k: int) -> None:
    """`speculative.speculator.COSTS` in plain decode steps, at a context of 300 tokens:
    f (verifying k + 1 tokens; for MTP also its draft step over the two positions a catch-up
    runs on after a fully accepted step) and c (one more draft); first, what a step of one
    sequence costs by its tokens (a verify step's rows)."""

    def span(n: int) -> list[TokenSpan]:
        return [TokenSpan(list(range(32)), 300, list(range(10, 10 + n)))]

    def mtp(n: int) -> float:
        """The drafter's step over n positions as it runs (compiled unless eager)."""
        proposer = target.speculator.proposer
        hidden = torch.zeros(n, target.model.config.hidden_size, dtype=target.runner.paged.dtype)
        return _ms(lambda: proposer.draft_rows(span(n), hidden))

    decode = _ms(lambda: target.runner.paged.forward(span(1)))
    verify = _ms(lambda: target.runner.paged.forward(span(k + 1))) / decode - 1
    sizes = sorted({1, 2, 4, k + 1, 8})
    rows = {n: _ms(lambda n=n: target.runner.paged.forward(span(n))) for n in sizes}
    print(
        f"one sequence's step of {' / '.join(map(str, rows))} tokens: "
        + " / ".join(f"{t:.2f}" for t in rows.values())
        + " ms; "
        + " / ".join(f"{t / rows[1]:.2f}x" for t in rows.values())
        + " a one-row step"
    )
    floor = weights_read(target.model, task_prompts(target.tokenizer, 8), list(rows))
    print(
        "weights such a step must read (each layer's experts its tokens route to, over 8 "
        "task prompts): " + " / ".join(f"{r:.2f}x" for r in floor.values()) + " a one-row step's"
    )
    draft_c = _ms(lambda: draft.runner.paged.forward(span(1))) / decode
    print(f"plain decode step {decode:.2f} ms; in decode steps:")
    print(f"  ngram: fixed {verify:.2f}, per draft 0")
    if isinstance(target.speculator.proposer, MTPProposer):  # the benchmark shape has none
        print(f"  mtp:   fixed {verify + mtp(2) / decode:.2f}, per draft {mtp(1) / decode:.2f}")
    print(f"  draft: fixed {verify:.2f}, per draft {draft_c:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=MODELS / "demo-full")
    parser.add_argument("--draft", type=Path, default=MODELS / "demo-draft")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--requests", type=int, default=16, help="per concurrency level")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--costs", action="store_true", help="measure the cost model only")
    parser.add_argument(
        "--drafters",
        nargs="+",
        choices=["ngram", "mtp", "draft"],
        default=["ngram", "mtp", "draft"],
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no compiled steps (the server compiles)"
    )
    parser.add_argument(
        "--mtp-head",
        type=Path,
        help="the target with another MTP head (`tierserve train mtp`'s model): drafts beside",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(enforce_eager=args.enforce_eager)
    if args.costs:
        # Speculating, so the graphs include a verify step's size; by the target's own MTP
        # layer where it has one (the benchmark shape has none).
        has_mtp = ModelConfig.from_file(args.target / "config.json").mtp is not None
        method = "mtp" if has_mtp else "ngram"
        spec = SpeculativeConfig(method=method, num_speculative_tokens=args.k)
        target = _ready(args.target, dataclasses.replace(config, speculative=spec))
        measure_costs(target, LLMEngine.from_checkpoint(args.draft), args.k)
        return

    specs = {
        "none": None,
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=args.k),
        "mtp": SpeculativeConfig(method="mtp", num_speculative_tokens=args.k),
        "draft": SpeculativeConfig(method="draft", model=args.draft, num_speculative_tokens=args.k),
    }
    engines = {
        name: _ready(args.target, dataclasses.replace(config, speculative=spec))
        for name, spec in specs.items()
        if name == "none" or name in args.drafters
    }
    if args.mtp_head is not None:
        spec = dataclasses.replace(config, speculative=specs["mtp"])
        engines[f"mtp ({args.mtp_head.parent.name})"] = _ready(args.mtp_head, spec)
    prompts = task_prompts(engines["none"].tokenizer, max(args.requests, max(args.concurrency)))
    print(
        f"target {args.target.name}, greedy, {len(prompts)} held-out task prompts "
        f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens), up to {args.new_tokens} "
        f"new tokens, k <= {args.k}, {args.threads} thread(s), median of {args.rounds} rounds, "
        + ("eager" if args.enforce_eager else "compiled steps")
    )
    rows = []
    total = len(args.concurrency) * args.rounds * len(engines)
    with tqdm(total=total, desc="bench", unit="run") as bar:
        for c in args.concurrency:
            speeds: dict[str, list[float]] = {name: [] for name in engines}
            decode: dict[str, list[float]] = {name: [] for name in engines}
            identical = dict.fromkeys(engines, True)
            before = {n: _counts(e) for n, e in engines.items()}
            run(engines["none"], prompts[:c], c, 8)  # warm-up
            for _ in range(args.rounds):
                reference = None
                for name, engine in engines.items():
                    speed = run(engine, prompts, c, args.new_tokens)
                    reference = reference or speed.outputs
                    identical[name] &= speed.outputs == reference
                    speeds[name].append(speed.overall)
                    decode[name].append(speed.decode)
                    bar.update()
            base = statistics.median(speeds["none"])
            decode_base = statistics.median(decode["none"])
            for name, engine in engines.items():
                drafts, draft_tokens, accepted = (
                    a - b for a, b in zip(_counts(engine), before[name], strict=True)
                )
                speed = statistics.median(speeds[name])
                decoding = statistics.median(decode[name])
                rows.append(
                    f"| {c} | {name} | {speed:.1f} | {speed / base:.2f}x | "
                    f"{decoding:.1f} | {decoding / decode_base:.2f}x | "
                    + (
                        f"{accepted / draft_tokens:.1%} | {1 + accepted / drafts:.2f} | "
                        if drafts
                        else "- | - | "
                    )
                    + ("yes" if identical[name] else "**NO**")
                    + " |"
                )
    print("| concurrency | drafter | output tok/s | vs none | decode steps' tok/s | vs none | "
          "acceptance | mean accepted length | greedy-identical |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def _ready(path: Path, config: EngineConfig) -> LLMEngine:
    """An engine whose compiled steps (unless eager) are all built, as a warm server's are."""
    engine = LLMEngine.from_checkpoint(path, config)
    engine.wait_warm()
    return engine


def _counts(engine: LLMEngine) -> tuple[int, int, int]:
    s = engine.speculator.stats if engine.speculator else None
    return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) if s else (0, 0, 0)


if __name__ == "__main__":
    main()
