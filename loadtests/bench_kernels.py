"""FP4 kernels: the CPU options for serving FP4 expert weights and, on a CUDA GPU, the
Triton kernels against bf16 PyTorch.

CPU (always): one MoE layer call of the benchmark shape (16 experts, hidden 256, expert
intermediate 384, top-2), 8 layers' worth of weights cycled so they do not stay in cache,
at 1, 4, 16 tokens (decode) and 256 (a prefill chunk), for each way to run FP4 weights:

- dequantize at load: fp32 weights resident (the unquantized path), 8x the FP4 memory;
- dequantize per step, nibbles: unpack, decode and scale the used experts each call;
- dequantize per step, lookup table: one gather per byte through the 64K-entry
  (scale byte, code byte) -> value pair table (`kernels.formats.scaled_pair_table`);
- compiled fused dequant-matmul: torch.compile of decode + scale + multiply + reduce, so
  the dequantized weight is never materialised.

CUDA (when present): the Triton W4A16 GEMM and fused MoE against bf16 `F.linear` and the
bf16 grouped experts, at decode and prefill sizes, with the weight bytes each reads per
second as a fraction of the device's copy bandwidth. Under TRITON_INTERPRET=1 on CPU the
same section runs once on tiny shapes to exercise it (its times mean nothing).

    python loadtests/bench_kernels.py [--format mxfp4|nvfp4]
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F

from kernels.formats import FP4Tensor, block_scale_values, quantize_mxfp4, quantize_nvfp4
from kernels.fp4 import decode_e2m1, unpack_fp4
from kernels.reference import fp4_moe, silu_and_mul
from serving.model.moe import grouped_experts, route

EXPERTS, HIDDEN, INTER, TOP_K, LAYERS = 16, 256, 384, 2, 8
QUANTIZE = {"mxfp4": quantize_mxfp4, "nvfp4": quantize_nvfp4}


def best_seconds(fn, repeats: int = 5) -> float:
    fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def fused_dequant_matmul(x, packed, scales, row_scale):
    """x [T, K] @ W.t() for W given as codes, fp32 block scales and a row scale [N], as one
    reduction that inductor fuses with the decoding."""
    values = decode_e2m1(unpack_fp4(packed))
    w = (values.unflatten(-1, (scales.shape[-1], -1)) * scales[..., None]).flatten(-2)
    return (x[:, None, :] * w[None]).sum(-1) * row_scale


def fp32_scaled(t: FP4Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert e's codes, block scales and row scale (ones for MXFP4) as the fused op takes them."""
    rows = t.packed.shape[1]
    row_scale = torch.ones(rows) if t.row_scale is None else t.row_scale[e]
    return t.packed[e], block_scale_values(t.scales[e], t.format), row_scale


def compiled_moe(fused):
    """The reference MoE's loop with each expert's MLP as compiled fused dequant-matmuls."""

    def moe(x, topk_weights, topk_ids, gate_up: FP4Tensor, down: FP4Tensor):
        flat = topk_ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=EXPERTS).tolist()
        token_of = order // topk_ids.shape[1]
        xs = x.index_select(0, token_of)
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                seg = slice(start, start + n)
                h = silu_and_mul(fused(xs[seg], *fp32_scaled(gate_up, e)))
                out[seg] = fused(h, *fp32_scaled(down, e))
                start += n
        slot_weights = topk_weights.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, token_of, out * slot_weights)

    return moe


def cpu_options(fmt: str) -> None:
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.02
        down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.02
        packed = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in (gate_up, down)]
        layers.append((packed, (QUANTIZE[fmt](gate_up), QUANTIZE[fmt](down))))
    fp32_bytes = sum(w.nbytes for (full, _) in layers for w in full)
    fp4_bytes = sum(t.nbytes() for (_, q) in layers for t in q)
    compiled = compiled_moe(torch.compile(fused_dequant_matmul, dynamic=True))
    options = {
        "dequantize at load (fp32)": (
            fp32_bytes,
            lambda x, w, i, L: grouped_experts(x, w, i, *L[0]),
        ),
        "per step, nibbles": (fp4_bytes, lambda x, w, i, L: fp4_moe(x, w, i, *L[1], lookup=False)),
        "per step, lookup table": (fp4_bytes, lambda x, w, i, L: fp4_moe(x, w, i, *L[1])),
        "compiled fused dequant-matmul": (
            fp4_bytes,
            lambda x, w, i, L: compiled(x, w, i, *L[1]),
        ),
    }
    tokens = (1, 4, 16, 256)
    print(
        f"\nCPU, {fmt}, {torch.get_num_threads()} threads: ms per MoE layer call (best of 5, "
        f"each call cycles through {LAYERS} layers' weights)"
    )
    print(
        "| option | resident expert weights MiB | " + " | ".join(f"{t} tok" for t in tokens) + " |"
    )
    print("|---|---|" + "---|" * len(tokens))
    for name, (nbytes, run) in options.items():
        cells = []
        for t in tokens:
            x = torch.randn(t, HIDDEN, generator=g)
            w, ids = route(torch.randn(t, EXPERTS, generator=g), TOP_K, True)
            seconds = best_seconds(
                lambda x=x, w=w, ids=ids, run=run: [run(x, w, ids, L) for L in layers]
            )
            cells.append(f"{seconds / LAYERS * 1e3:.2f}")
        print(f"| {name} | {nbytes / 2**20:.1f} | " + " | ".join(cells) + " |", flush=True)


def copy_bandwidth(device: str) -> float:
    """Bytes moved per second by a large device copy (read + write): the ceiling."""
    a = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * a.nbytes / best_seconds(lambda: b.copy_(a))


def triton_vs_bf16(fmt: str, device: str, tiny: bool) -> None:
    from kernels.triton_gemm import w4a16_gemm
    from kernels.triton_moe import fused_moe

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    peak = copy_bandwidth(device)
    n, k = (64, 64) if tiny else (8192, 8192)
    w = torch.randn(n, k, device=device) * 0.02
    q = QUANTIZE[fmt](w)
    for name in ("packed", "scales", "row_scale"):
        if getattr(q, name) is not None:
            setattr(q, name, getattr(q, name).to(device))
    wb = w.to(dtype)
    print(f"\n{device}: copy bandwidth {peak / 1e9:.0f} GB/s; W4A16 GEMM, W [{n}, {k}] {fmt}")
    print("| M | bf16 F.linear us | Triton FP4 us | speed-up | FP4 weight GB/s | of copy bw |")
    print("|---|---|---|---|---|---|")
    for m in (1, 16) if tiny else (1, 4, 16, 64, 256, 1024):
        x = torch.randn(m, k, device=device, dtype=dtype)
        t_ref = best_seconds(lambda x=x: F.linear(x, wb))
        t_fp4 = best_seconds(lambda x=x: w4a16_gemm(x, q))
        gbs = q.nbytes() / t_fp4
        print(
            f"| {m} | {t_ref * 1e6:.1f} | {t_fp4 * 1e6:.1f} | {t_ref / t_fp4:.2f}x "
            f"| {gbs / 1e9:.0f} | {gbs / peak:.0%} |"
        )
    e, h, i = (4, 64, 32) if tiny else (128, 2048, 768)  # a Qwen3-30B-A3B-sized layer
    top_k = 2 if tiny else 8
    gate_up = torch.randn(e, 2 * i, h, device=device) * 0.02
    down = torch.randn(e, h, i, device=device) * 0.02
    q_gu, q_d = QUANTIZE[fmt](gate_up), QUANTIZE[fmt](down)
    for t in (q_gu, q_d):
        for name in ("packed", "scales", "row_scale"):
            if getattr(t, name) is not None:
                setattr(t, name, getattr(t, name).to(device))
    gb, db = gate_up.to(dtype), down.to(dtype)
    print(f"\nfused MoE, {e} experts, hidden {h}, intermediate {i}, top-{top_k}, {fmt}")
    print("| tokens | bf16 grouped us | Triton FP4 us | speed-up | FP4 weight GB/s | of copy bw |")
    print("|---|---|---|---|---|---|")
    for tokens in (1, 8) if tiny else (1, 16, 64, 512, 2048):
        x = torch.randn(tokens, h, device=device, dtype=dtype)
        w, ids = route(torch.randn(tokens, e, device=device), top_k, True)
        t_ref = best_seconds(lambda x=x, w=w, ids=ids: grouped_experts(x, w, ids, gb, db))
        t_fp4 = best_seconds(lambda x=x, w=w, ids=ids: fused_moe(x, w, ids, q_gu, q_d))
        used = ids.unique().numel()
        gbs = used * (q_gu.nbytes() + q_d.nbytes()) / e / t_fp4
        print(
            f"| {tokens} | {t_ref * 1e6:.1f} | {t_fp4 * 1e6:.1f} | {t_ref / t_fp4:.2f}x "
            f"| {gbs / 1e9:.0f} | {gbs / peak:.0%} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--format", choices=sorted(QUANTIZE), default="mxfp4")
    ap.add_argument(
        "--threads", type=int, default=2, help="CPU threads (1 is steadier on a busy machine)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu_options(args.format)
    if torch.cuda.is_available():
        triton_vs_bf16(args.format, "cuda", tiny=False)
    elif os.environ.get("TRITON_INTERPRET") == "1":
        print(
            "\n(TRITON_INTERPRET=1 without a GPU: the Triton section on tiny shapes, "
            "to exercise it; its times mean nothing)"
        )
        triton_vs_bf16(args.format, "cpu", tiny=True)
    else:
        print("\nNo CUDA GPU: the Triton section did not run.")


if __name__ == "__main__":
    main()
