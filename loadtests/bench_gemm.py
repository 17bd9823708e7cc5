"""How fast this machine's BLAS reads weights in the skinny products of decoding.

A decode step multiplies a few activation rows by large weight matrices, so it is bound by
how fast the weights stream from memory. This prints, for the expert matrices of the
benchmark shape (16 experts, gate_up 256 x 768 each, all layers' worth so nothing stays in
cache), the effective weight bandwidth of torch's matrix products at 1, 4 and 16 rows next
to a plain streaming read of the same bytes, which is the ceiling, for the two layouts of a
weight W [out, in]: as stored (`F.linear` multiplies by a transposed operand) and packed
(the same matrix laid out transposed in memory, so the product reads it row by row; what
`serving.model.causal_lm.pack_for_inference` does); then oneDNN's product over its blocked
copy of the weight (`serving.model.linear.pack_onednn`, an eager LM head's), and the C++ op
of `kernels/cpu_dense.py` over the weight as stored.

    python loadtests/bench_gemm.py
"""

import time

import torch
import torch.nn.functional as F

from kernels import cpu_dense

EXPERTS, HIDDEN, INTER, LAYERS = 16, 256, 384, 8


def best_seconds(fn, repeats: int = 8) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.set_num_threads(2)
    weights = [torch.randn(EXPERTS * 2 * INTER, HIDDEN) for _ in range(LAYERS)]
    gbytes = sum(w.numel() * w.element_size() for w in weights) / 1e9
    read = best_seconds(lambda: [w.sum() for w in weights])
    print(f"{gbytes * 1e3:.0f} MB of fp32 weights, {torch.get_num_threads()} threads")
    print(f"streaming read (sum): {gbytes / read:.1f} GB/s")
    packed = [w.t().contiguous().t() for w in weights]
    blocked = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    onednn = torch.ops.mkldnn._linear_pointwise
    for rows in (1, 2, 4, 16):
        x = torch.randn(rows, HIDDEN)
        products = {
            "F.linear, as stored": lambda x=x: [F.linear(x, w) for w in weights],
            "F.linear, packed": lambda x=x: [F.linear(x, w) for w in packed],
            "oneDNN, blocked": lambda x=x: [onednn(x, w, None, "none", [], "") for w in blocked],
        }
        if cpu_dense.available():  # else it warned why
            products["dense op, as stored"] = lambda x=x: [
                cpu_dense.dense_linear(x, w) for w in weights
            ]
        for name, product in products.items():
            t = best_seconds(product)
            print(f"{name:19s} {rows:2d} rows: {gbytes / t:5.1f} GB/s ({read / t:.0%} of the read)")


if __name__ == "__main__":
    main()
