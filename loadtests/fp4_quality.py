"""How far FP4 moves the model: KL divergence and top-1 agreement of next-token
distributions against the unquantized checkpoint, per FP4 variant.

`--checkpoint` is the model to quantize: by default the common benchmark checkpoint (random
weights, `bench-moe-43m.json`, built if missing), whose nearly flat distributions (the
entropy is printed next to ln(vocab)) bound the numerical change; pass a trained one
(`--checkpoint ../models/demo-highspeed`) to see it on real distributions. 16 random prompts
of 128 tokens, every position scored. Task quality is `tierserve eval` on both checkpoints.

    python loadtests/fp4_quality.py
"""

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_engine import build_checkpoint
from bench_fp4_engine import variant_checkpoints

from serving.model.checkpoint import load_checkpoint


@torch.inference_mode()
def log_probs(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = load_checkpoint(path)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    return model.compute_logits(model(ids, positions)).log_softmax(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/tierserve-bench-moe-43m"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    paths = variant_checkpoints(build_checkpoint(args.checkpoint))
    vocab = load_checkpoint(paths["fp32"]).config.vocab_size
    ids = torch.randint(0, vocab, (16, 128), generator=torch.Generator().manual_seed(0))
    ref = log_probs(paths.pop("fp32"), ids)
    entropy = -(ref.exp() * ref).sum(-1).mean().item()
    print(f"fp32 next-token entropy {entropy:.3f} nats (uniform: {math.log(vocab):.3f})")
    print("| model | KL(fp32 || fp4) nats/token | top-1 agreement |")
    print("|---|---|---|")
    for name, path in paths.items():
        got = log_probs(path, ids)
        kl = F.kl_div(got, ref, log_target=True, reduction="none").sum(-1).mean().item()
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"| {name} | {kl:.2e} | {top1:.1%} |", flush=True)


if __name__ == "__main__":
    main()
