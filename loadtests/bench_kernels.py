"""FP4 kernels: the CPU options for serving FP4 weights and, on a CUDA GPU, the Triton kernels
against bf16 PyTorch.

CPU (always): one MoE layer call of the benchmark shape (16 experts, hidden 256, expert
intermediate 384, top-2), 8 layers' worth of weights cycled so they do not stay in cache,
at 1, 4, 16, 32, 64 tokens (decode) and 256 (a prefill chunk), for each way to run the experts:

- dense fp32 weights (FP4 dequantized at load), and dense bf16 weights held in bf16 and
  widened as they are used, each in the grouped form (`grouped_experts`: training, and eager
  steps of many tokens), in the dense C++ op (`kernels.cpu_dense.dense_moe`: inference steps
  of up to `moe.DENSE_OP_MAX_TOKENS`), and as one-token compiled steps do (`gathered_experts`
  under `torch.compile`, decode sizes only);
- FP4 dequantized per step through the lookup table (`kernels.reference.fp4_moe`);
- FP4 kept FP4: the C++ op (`kernels.cpu_fp4.fp4_moe`), which decodes each block in
  registers inside its products;

and one FP4 projection of the benchmark's dense-MLP shape (W [2048, 256]) through the C++ op
against `F.linear` on fp32 weights and on bf16 weights widened per call, at 1-32 rows.

CUDA (when present): the Triton W4A16 GEMM and fused MoE against bf16 `F.linear` and the
bf16 grouped experts, at decode and prefill sizes, with the weight bytes each reads per
second as a fraction of the device's copy bandwidth. Under TRITON_INTERPRET=1 on CPU the
same section runs once on tiny shapes to exercise it (its times mean nothing).

    python loadtests/bench_kernels.py [--format mxfp4|nvfp4] [--threads 2]
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F

from kernels import cpu_dense, cpu_fp4
from kernels.formats import FP4Tensor, quantize_mxfp4, quantize_nvfp4
from kernels.reference import fp4_moe
from serving.model.moe import gathered_experts, grouped_experts, route

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


def cpu_experts(fmt: str) -> None:
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.02
        down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.02
        layers.append(
            {
                "fp32": (gate_up, down),
                "bf16": (gate_up.bfloat16(), down.bfloat16()),
                "fp4": (QUANTIZE[fmt](gate_up), QUANTIZE[fmt](down)),
            }
        )
    gathered = torch.compile(gathered_experts, dynamic=False)
    options = {  # name: (weights, run, decode sizes only)
        "fp32, eager (grouped)": ("fp32", grouped_experts, False),
        "bf16 held, eager (grouped)": ("bf16", grouped_experts, False),
        "fp32, compiled (gathered)": ("fp32", gathered, True),
        "bf16 held, compiled (gathered)": ("bf16", gathered, True),
        "FP4 dequantized per step (reference)": ("fp4", fp4_moe, False),
        "FP4 kept FP4 (C++ op)": ("fp4", cpu_fp4.fp4_moe, False),
    }
    if cpu_dense.available():  # else it warned why
        options["fp32, the dense C++ op"] = ("fp32", cpu_dense.dense_moe, False)
        options["bf16 held, the dense C++ op"] = ("bf16", cpu_dense.dense_moe, False)
    tokens = (1, 4, 16, 32, 64, 256)
    print(
        f"\nCPU, {fmt}, {torch.get_num_threads()} threads: ms per MoE layer call (best of 5, "
        f"each call cycles through {LAYERS} layers' weights); (x): the C++ op's speed-up"
    )
    print("| experts | MiB resident | " + " | ".join(f"{t} tok" for t in tokens) + " |")
    print("|---|---|" + "---|" * len(tokens))
    inputs = []
    for t in tokens:
        x = torch.randn(t, HIDDEN, generator=g)
        inputs.append((x, *route(torch.randn(t, EXPERTS, generator=g), TOP_K, True)))
    times = {}
    for name, (kind, run, decode_only) in options.items():
        times[name] = [
            None
            if decode_only and x.shape[0] > 32
            else best_seconds(
                lambda x=x, w=w, i=i, run=run, kind=kind: [run(x, w, i, *L[kind]) for L in layers]
            )
            / LAYERS
            for x, w, i in inputs
        ]
    op = times["FP4 kept FP4 (C++ op)"]
    for name, (kind, _, _) in options.items():
        cells = [
            "-" if t is None else f"{t * 1e3:.3f} ({t / o:.2f}x)"
            for t, o in zip(times[name], op, strict=True)
        ]
        nbytes = sum(
            t.nbytes() if isinstance(t, FP4Tensor) else t.nbytes for L in layers for t in L[kind]
        )
        print(f"| {name} | {nbytes / 2**20:.1f} | " + " | ".join(cells) + " |", flush=True)


def cpu_linear(fmt: str) -> None:
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(2048, HIDDEN, generator=g) * 0.02 for _ in range(LAYERS)]
    plain = {"fp32": weights, "bf16 held": [w.bfloat16() for w in weights]}
    fp4 = [QUANTIZE[fmt](w) for w in weights]
    print(
        f"\nCPU, {fmt}: one projection W [2048, {HIDDEN}], us per call ({LAYERS} weights "
        "cycled); (x): the C++ op's speed-up"
    )
    print("| rows | fp32 F.linear | bf16 held F.linear | FP4 kept FP4 (C++ op) |")
    print("|---|---|---|---|")
    for m in (1, 4, 16, 32):
        x = torch.randn(m, HIDDEN, generator=g)
        t_op = best_seconds(lambda x=x: [cpu_fp4.fp4_linear(x, w) for w in fp4]) / LAYERS
        cells = []
        for ws in plain.values():
            t = best_seconds(lambda x=x, ws=ws: [F.linear(x, w.to(x.dtype)) for w in ws]) / LAYERS
            cells.append(f"{t * 1e6:.1f} ({t / t_op:.2f}x)")
        print(f"| {m} | " + " | ".join(cells) + f" | {t_op * 1e6:.1f} |", flush=True)


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
    if not cpu_fp4.available():
        raise SystemExit("the C++ FP4 ops could not be built: nothing to measure on the CPU")
    cpu_experts(args.format)
    cpu_linear(args.format)
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
