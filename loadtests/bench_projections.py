"""One row's projection inside a compiled decode step: inductor's fused reduction against the
C++ op of `kernels/cpu_dense.py`, by weight shape (`serving/model/linear.py` picks by size);
then eagerly, as an engine computes its LM head after a step: oneDNN's product against the op
(bf16 only where the CPU computes it natively, as the engine packs it only there).

Each graph runs eight projections of one shape, chained as a step's are (each output feeds
the next), so a call's fixed cost is shared as in a real step; the two forms alternate within
each round and the median of the rounds is printed, per projection, with the ratio.

    python loadtests/bench_projections.py [--threads 1] [--rounds 5]
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kernels import cpu_dense
from serving.model.dtype import is_supported

# (rows of the weight, its columns): a decoder layer's qkv and o of the demo models, the MTP
# layer's eh_proj, demo-highspeed's LM head, the benchmark shape's LM head.
SHAPES = [(512, 256), (256, 256), (256, 512), (2746, 256), (8192, 256)]
CHAIN = 8
# (weights, activations): a bf16 checkpoint computed in fp32, computed in bf16, fp32.
DTYPES = [
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
]


def _next(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The next projection's input: this one's output, cut or repeated to x's width."""
    k, n = x.shape[-1], y.shape[-1]
    return x + (y[..., :k] if n >= k else y.repeat(1, k // n))


def reduction(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    for w in ws:
        x = _next(x, (x.unsqueeze(-2) * w).sum(-1))
    return x


def op(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    for w in ws:
        x = _next(x, cpu_dense.dense_linear(x, w))
    return x


def onednn(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """Eagerly, oneDNN's product over each weight's blocked copy (`linear.pack_onednn`)."""
    for w in ws:
        x = _next(x, torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    return x


def _us(fn, calls: int = 500) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls / CHAIN * 1e6


def _operands(n: int, k: int, dtype: torch.dtype, x_dtype: torch.dtype):
    """`CHAIN` weights [n, k] of `dtype` and one row of `x_dtype`, the same for a shape."""
    g = torch.Generator().manual_seed(n + k)
    ws = [(torch.randn(n, k, generator=g) * k**-0.5).to(dtype) for _ in range(CHAIN)]
    return ws, torch.randn(1, k, generator=g).to(x_dtype)


def _medians(forms: dict[str, Callable[[], object]], rounds: int) -> list[float]:
    """us per projection of each form, alternating within each round, medians."""
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name, form in forms.items():
            times[name].append(_us(form))
    return [statistics.median(t) for t in times.values()]


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # a graph per shape and dtype
    if not cpu_dense.available():
        raise SystemExit("the C++ dense ops could not be built: nothing to compare")
    print(f"one row, {args.threads} thread(s), us per projection, median of {args.rounds} rounds")
    print("| weight | weights, activations | fused reduction | C++ op | op / reduction |")
    print("|---|---|---|---|---|")
    for n, k in SHAPES:
        for dtype, x_dtype in DTYPES:
            ws, x = _operands(n, k, dtype, x_dtype)
            forms = {}
            for f in (reduction, op):
                compiled = torch.compile(f, dynamic=False, fullgraph=True)
                compiled(x, ws)
                forms[f.__name__] = lambda c=compiled, x=x, ws=ws: c(x, ws)
            red, cpp = _medians(forms, args.rounds)
            name = ", ".join(str(d).removeprefix("torch.") for d in (dtype, x_dtype))
            print(f"| [{n}, {k}] | {name} | {red:.1f} | {cpp:.1f} | {cpp / red:.2f}x |")
    print("\nEager, as an engine's LM head: oneDNN over its blocked copy of the weight")
    print("(`linear.pack_onednn`) against the C++ op over the weight as stored, us per projection")
    print("| weight | dtype | oneDNN | C++ op | op / oneDNN |")
    print("|---|---|---|---|---|")
    for n, k in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            if not is_supported(dtype):
                continue
            ws, x = _operands(n, k, dtype, dtype)
            blocked = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
            forms = {
                "onednn": lambda x=x, b=blocked: onednn(x, b),
                "op": lambda x=x, ws=ws: op(x, ws),
            }
            dnn, cpp = _medians(forms, args.rounds)
            name = str(dtype).removeprefix("torch.")
            print(f"| [{n}, {k}] | {name} | {dnn:.1f} | {cpp:.1f} | {cpp / dnn:.2f}x |")
    if not is_supported(torch.bfloat16):
        print("(no bf16 rows: this CPU computes bf16 in fp32, and the engine packs no bf16 head)")


if __name__ == "__main__":
    main()
