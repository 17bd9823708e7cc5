"""Hybrid attention at long context: cache bytes per sequence and decode step time, against
full attention.

Two models of one shape, random weights: the hybrid (Gated DeltaNet layers three to one gated
full-attention layer, as Qwen3-Next) and the same shape with every layer full attention.

- Bytes: KV cache plus DeltaNet state of one sequence at `--context` tokens, read off the
  tensors an engine allocates for each model (per token of its KV cache, per state slot), with
  the engine's formulas checked against them; and by those formulas for Qwen3-Next-80B-A3B's
  published shape in bf16.
- Decode: one sequence's engine step (forward and sampling, eager, as the engine runs the
  hybrid family) at 1k and at `--context` tokens of context, taking turns, median of
  `--repeats` each.

The context is not prefilled: its blocks get random keys and values and its slot a random
state, then the sequence decodes. A decode step reads the whole context whatever it holds, so
its cost depends on the length alone, and prefilling 32k tokens of the full-attention model
eagerly on a small CPU would take most of the run.

    python loadtests/bench_hybrid.py [--context 32768] [--repeats 10] [--threads 2]
        [--shape qwen3-next-width|half-width] [--kv-cache-dtype float32|bfloat16]
"""

import argparse
import statistics
import time

import torch

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.engine.sequence import Sequence
from serving.model.dtype import DTYPES
from serving.model.hybrid.config import FULL, LINEAR, HybridConfig
from serving.model.hybrid.model import HybridCausalLM
from serving.model.hybrid.paged import hybrid_kv_bytes_per_block
from serving.model.hybrid.slots import deltanet_layers, state_bytes_per_slot
from serving.sampling.params import SamplingParams

BLOCK = 16
SHORT = 1024
# Qwen3-Next-80B-A3B's config.json (bf16): the layout that matters for cache bytes.
QWEN3_NEXT_80B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5120,
    num_hidden_layers=48,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    rope_theta=10000000.0,
    partial_rotary_factor=0.25,
    max_position_embeddings=65536,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)
# The shapes timed (random weights, fp32, dense MLPs): Qwen3-Next's widths in 8 of its 48
# layers, each MLP as large as the experts a token runs there (10 routed and the shared one,
# 512 wide each), so weights and cache bytes stand in its proportions; and a half-width
# shape that runs twice as fast.
SHAPES = {
    "qwen3-next-width": QWEN3_NEXT_80B
    | dict(vocab_size=4096, num_hidden_layers=8, intermediate_size=11 * 512),
    "half-width": QWEN3_NEXT_80B
    | dict(
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=8,
        head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
    ),
}


def config(shape: dict, hybrid: bool) -> HybridConfig:
    layers = shape["num_hidden_layers"]
    types = [FULL if not hybrid or (i + 1) % 4 == 0 else LINEAR for i in range(layers)]
    return HybridConfig(layer_types=types, **shape)


def formula_bytes(
    cfg: HybridConfig, tokens: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> int:
    """KV cache (in `kv_dtype`, default the model's) and state of one sequence of `tokens`
    tokens, by the engine's formulas."""
    blocks = -(-tokens // BLOCK)
    kv = hybrid_kv_bytes_per_block(cfg, BLOCK, kv_dtype or dtype)
    return blocks * kv + state_bytes_per_slot(cfg, dtype)


def build_engine(cfg: HybridConfig, context: int, kv_dtype: str) -> LLMEngine:
    torch.manual_seed(0)
    model = HybridCausalLM(cfg).eval()
    # Two sequences: the long context's and the short one's, each with its slot.
    budget = formula_bytes(cfg, context + 1, torch.float32, DTYPES[kv_dtype])
    budget += formula_bytes(cfg, SHORT + 1, torch.float32, DTYPES[kv_dtype])
    config = EngineConfig(max_num_seqs=2, kv_cache_bytes=budget, kv_cache_dtype=kv_dtype)
    return LLMEngine(model, config, eos_token_ids=[])


def allocated_bytes(engine: LLMEngine, tokens: int) -> int:
    """What the engine's tensors hold for one sequence of `tokens` tokens: its blocks' share
    of the KV cache tensors and one slot's share of the state tensors."""
    caches = [
        (layer.self_attn.k_cache, layer.self_attn.v_cache)
        for layer in engine.model.layers
        if not layer.is_linear
    ]
    per_block = sum(k.nbytes + v.nbytes for k, v in caches) // caches[0][0].shape[0]
    slots = deltanet_layers(engine.model)
    state = sum(s.conv_slots.nbytes + s.recurrent_slots.nbytes for s in slots)
    return -(-tokens // BLOCK) * per_block + state // engine.state_slots.num_slots


def context_sequence(engine: LLMEngine, context: int, g: torch.Generator) -> Sequence:
    """A sequence about to decode its token at position `context`, its context's blocks and
    its slot filled with random values as if prefilled."""
    tokens = torch.randint(0, engine.model.config.vocab_size, (context + 1,), generator=g)
    seq = Sequence(f"ctx{context}", tokens.tolist(), SamplingParams(max_tokens=1, temperature=0))
    assert engine.state_slots.allocate(seq) and engine.blocks.allocate_slots(seq, context + 1)
    seq.num_computed_tokens = seq.num_prompt_tokens = context
    with torch.no_grad():
        for layer in engine.model.layers:
            if layer.is_linear:
                layer.linear_attn.conv_slots[seq.state_slot].normal_(generator=g)
                layer.linear_attn.recurrent_slots[seq.state_slot].normal_(generator=g)
            else:
                for cache in (layer.self_attn.k_cache, layer.self_attn.v_cache):
                    cache[seq.block_table].normal_(generator=g)
    return seq


def decode_seconds(engine: LLMEngine, contexts: list[int], repeats: int) -> list[float]:
    """Median engine step of one sequence decoding at each context length. The lengths take
    turns step by step, so a slow period of a shared machine hits them alike."""
    g = torch.Generator().manual_seed(1)
    seqs = [context_sequence(engine, c, g) for c in contexts]
    times: list[list[float]] = [[] for _ in contexts]
    for i in range(repeats + 2):
        for seq, t in zip(seqs, times, strict=True):
            start = time.perf_counter()
            engine.runner.run([(seq, 1)])
            if i >= 2:  # two warm-up rounds
                t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-next-width")
    parser.add_argument(
        "--kv-cache-dtype", choices=list(DTYPES), default="float32", help="both models' caches"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ctx = args.context

    print(f"KV cache + DeltaNet state per sequence at {ctx} tokens")
    print(f"{'model':<44} {'hybrid':>10} {'full attn':>10} {'ratio':>6}")
    bf16 = torch.bfloat16
    big = [formula_bytes(config(QWEN3_NEXT_80B, h), ctx, bf16) for h in (True, False)]
    print(f"{'Qwen3-Next-80B-A3B shape, bf16':<44} {_mib(big[0])} {_mib(big[1])} "
          f"{big[0] / big[1]:>5.2f}x")  # fmt: skip

    engines, measured = {}, []
    for hybrid in (True, False):
        cfg = config(SHAPES[args.shape], hybrid)
        engines[hybrid] = engine = build_engine(cfg, ctx, args.kv_cache_dtype)
        measured.append(allocated_bytes(engine, ctx))
        if measured[-1] != formula_bytes(cfg, ctx, torch.float32, DTYPES[args.kv_cache_dtype]):
            raise AssertionError("the engine allocates other than its formulas say")
    params = [sum(p.numel() for p in engines[h].model.parameters()) / 1e6 for h in (True, False)]
    label = f"{args.shape}, fp32, {args.kv_cache_dtype} KV ({params[0]:.0f}M / {params[1]:.0f}M)"
    print(f"{label:<44} {_mib(measured[0])} {_mib(measured[1])} "
          f"{measured[0] / measured[1]:>5.2f}x")  # fmt: skip

    print(f"\nDecode step, one sequence, {args.threads} threads (median of {args.repeats})")
    print(f"{'model':<12} {f'{SHORT} ctx':>10} {f'{ctx} ctx':>10} {'ratio':>6} {'added':>9}")
    for hybrid, name in ((True, "hybrid"), (False, "full attn")):
        short, long = decode_seconds(engines[hybrid], [SHORT, ctx], args.repeats)
        print(
            f"{name:<12} {short * 1e3:>8.1f}ms {long * 1e3:>8.1f}ms {long / short:>5.2f}x "
            f"{(long - short) * 1e3:>7.1f}ms"
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:>7.1f}MiB"


if __name__ == "__main__":
    main()
