"""Sparse MoE MLP of Qwen3-MoE: softmax router, top-k experts, grouped expert compute.

Expert weights are held fused, `gate_up [E, 2I, H]` (gate rows first, then up) and
`down [E, H, I]`, the layout transformers uses in memory, so expert compute is a
grouped product over tokens sorted by expert rather than one module per expert.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_dense, ops
from kernels.modules import QuantizedWeight
from kernels.reference import silu_and_mul
from serving.model.config import ModelConfig
from serving.model.linear import Linear


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def route(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token and their weights, softmax in fp32 as transformers does."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


# A training step's expert slices in half precision on a CPU are padded to a multiple of this
# many rows. oneDNN, which computes them, builds a kernel for every new product shape (at
# these sizes costlier than the product itself) and keeps the shapes it has seen; a step's
# slices take new row counts every step, so nearly every product paid for a build
# (`loadtests/bench_train_step.py`). Padded, the shapes recur. fp32 goes to MKL, which builds
# nothing; an inference step's slices, smaller and without a backward pass, ran no faster
# padded.
TRAINING_SEGMENT_ROWS = 64


def _trains_through_onednn(x: torch.Tensor) -> bool:
    return (
        torch.is_grad_enabled()
        and x.device.type == "cpu"
        and (x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"))
    )


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) for x [T, H].

    A single token just runs its k experts. Otherwise token slots are sorted by expert and:
    - in small batches touching most experts (decoding many sequences; on more than one
      thread, batches up to a few hundred tokens), all experts run as one batched product
      over slices padded to the busiest expert: one call that reads every expert's weights
      once instead of E small calls, and splits the experts over the threads;
    - otherwise (prefill, or few experts in use) each used expert runs one product over its
      exact, contiguous slice, wasting nothing on padding.

    Expert weights stored narrower than x (a bf16 checkpoint's experts on a CPU that computes
    in fp32, `load_checkpoint`) are widened as they are used, only the experts a step runs.
    """
    if x.shape[0] == 1:
        y = None
        # Weights rounded to the activations' dtype first, as transformers does.
        for e, w in zip(experts[0].tolist(), weights[0].to(x.dtype), strict=True):
            o = silu_and_mul(x @ gate_up[e].to(x.dtype).t()) @ down[e].to(x.dtype).t() * w
            y = o if y is None else y + o
        return y
    num_experts = gate_up.shape[0]
    top_k = experts.shape[1]
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    token_of = order // top_k
    slot_weights = weights.flatten()[order].unsqueeze(-1).to(x.dtype)
    xs = x.index_select(0, token_of)  # index_select: much cheaper than x[idx] on CPU
    capacity = int(counts.max())
    limit = PADDED_CAPACITY if torch.get_num_threads() == 1 else PADDED_CAPACITY_THREADED
    if capacity <= limit and 4 * int(counts.count_nonzero()) >= 3 * num_experts:
        sorted_experts = flat[order]
        rank = (
            torch.arange(flat.numel(), device=x.device)
            - (counts.cumsum(0) - counts)[sorted_experts]
        )
        slot = sorted_experts * capacity + rank  # row in the [E * capacity] padded layout
        padded = x.new_zeros(num_experts * capacity, x.shape[-1]).index_copy_(0, slot, xs)
        gate_up, down = gate_up.to(x.dtype), down.to(x.dtype)
        h = silu_and_mul(torch.bmm(padded.view(num_experts, capacity, -1), gate_up.transpose(1, 2)))
        out = torch.bmm(h, down.transpose(1, 2)).flatten(0, 1).index_select(0, slot)
    else:
        out = torch.empty_like(xs)
        start = 0
        multiple = TRAINING_SEGMENT_ROWS if _trains_through_onednn(x) else 1
        for e, n in enumerate(counts.tolist()):
            if n:
                seg = slice(start, start + n)
                w1, w2 = gate_up[e].to(x.dtype), down[e].to(x.dtype)
                rows = xs[seg]
                if n % multiple:  # zero rows, whose outputs are zero and cut off
                    rows = F.pad(rows, (0, 0, 0, -n % multiple))
                out[seg] = (silu_and_mul(rows @ w1.t()) @ w2.t())[:n]
                start += n
    return torch.zeros_like(x).index_add_(0, token_of, out * slot_weights)


def gathered_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """`grouped_experts` written for a compiled decode step (at most 32 tokens), where the C++
    op that reads each used expert once a step (`kernels/cpu_dense.py`) does not run: a single
    token in fp32 (which reads its experts once either way), an op that was not built, or
    weights neither fp32 nor bf16.

    Each token's expert weights are indexed and reduced against it in fp32, which inductor
    fuses into one loop that reads the indexed weights in place (no gathered copy), row-major
    as checkpoints store them, with no library call and no Python. Every token reads its own
    experts, so a step's cost grows with its tokens, yet it beats the grouped op's products at
    every graph size (`loadtests/bench_kernels.py`)."""
    h = (x[:, None, None, :].float() * gate_up[experts].float()).sum(-1)  # [T, k, 2I]
    a = silu_and_mul(h.to(x.dtype))
    o = (a[:, :, None, :].float() * down[experts].float()).sum(-1).to(x.dtype)  # [T, k, H]
    return (o * weights.to(x.dtype)[..., None]).sum(1)


# Above this many tokens per expert, padding costs more than the per-expert calls it saves.
PADDED_CAPACITY = 16
# With more threads, one product of a few rows stays on one thread while the batched product
# splits the experts over the threads, so padding pays far longer: on two threads the padded
# form was the faster up to the largest batches measured, on one thread the two are even
# sooner (`loadtests/bench_kernels.py` times the expert forms).
PADDED_CAPACITY_THREADED = 128


# Inference steps of up to this many tokens, compiled or eager, run their experts in the C++
# op of `kernels/cpu_dense.py` (a compiled step has at most `linear.REDUCTION_MAX_ROWS`): one
# call that reads each used expert once, where the grouped form is a dozen ATen calls and,
# for weights held narrower, widens every expert each call. Past it the grouped form's
# batched products do as well or better, the better the more a layer's experts stay in cache
# (`loadtests/bench_kernels.py` times the expert forms, weights cycled out of cache).
DENSE_OP_MAX_TOKENS = 64


class SparseMoE(nn.Module):
    """`gate_up` and `down` are parameters, or `QuantizedWeight`s in an FP4 model."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = Linear(h, e, bias=False)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down = nn.Parameter(torch.empty(e, h, i))

    def forward(
        self, x: torch.Tensor, router_logits_out: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        if router_logits_out is not None:
            router_logits_out.append(logits)
        weights, experts = route(logits, self.top_k, self.norm_topk_prob)
        gate_up, down = self.gate_up, self.down
        fp4 = isinstance(gate_up, QuantizedWeight)
        if fp4:
            gate_up, down = gate_up.tensor, down.tensor
        if ops.use_triton(x.device):
            y = ops.fused_moe(x, weights, experts, gate_up, down)
        elif fp4:
            y = ops.fp4_experts(x, weights, experts, gate_up, down)
        elif (
            not torch.is_grad_enabled()
            and x.shape[0] <= DENSE_OP_MAX_TOKENS
            and cpu_dense.runs(x, gate_up, down)
        ):
            y = cpu_dense.dense_moe(x, weights, experts, gate_up, down)
        elif torch.compiler.is_compiling() and not torch.is_grad_enabled():  # a decode graph
            y = gathered_experts(x, weights, experts, gate_up, down)
        else:
            y = grouped_experts(x, weights, experts, gate_up, down)
        return y.view(shape)
