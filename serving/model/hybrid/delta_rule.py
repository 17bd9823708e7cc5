"""The gated delta rule, the recurrence of Gated DeltaNet, in two equivalent forms.

Per head, with a state S [Dk, Dv], a decay g_t <= 0 (log space) and a write strength beta_t:

    S_t = exp(g_t) S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
    o_t = S_t^T q_t

`recurrent_gated_delta_rule` steps it token by token: the decode form, one token per sequence,
O(Dk Dv) per token whatever the context length. `chunked_gated_delta_rule` is the prefill
form: within a chunk of C tokens the deltas solve one triangular system (the WY / UT
representation), so a chunk costs a few matrix products instead of C dependent steps, and
only the chunk-to-chunk state update is sequential. Both take and return the state, so a
prefill in chunks followed by decode steps computes exactly the one long recurrence.

Tensors are [B, H, L, D] with q and k already l2-normalised and q scaled; g and beta are
[B, H, L]. Everything runs in fp32; the state is fp32 [B, H, Dk, Dv]. A token with g = 0 and
beta = 0 leaves the state as it was: how padding passes through.

On CUDA the sequential parts, the token-by-token recurrence and the chunk-to-chunk one, run
as Triton kernels that hold the state in registers (`kernels/triton_delta_rule.py`); the
work within chunks stays the batched PyTorch below on every device. The kernels have no
backward, so a call that training differentiates runs the PyTorch forms on CUDA too
(`_triton`).
"""

import torch
import torch.nn.functional as F

from kernels import ops

CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dimension (eps inside the root, as FLA's kernels)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _triton(*tensors: torch.Tensor) -> bool:
    """Whether the Triton forms may run: on CUDA, where no input needs a gradient."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return ops.use_triton(tensors[0].device) and not needs_grad


def _zero_state(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    b, h, _, dk = k.shape
    return k.new_zeros(b, h, dk, v.shape[-1])


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    every_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs [B, H, L, Dv] and the state after the last token, one token at a time; with
    `every_state`, the state after each token instead, [B, H, L, Dk, Dv] (a verified
    speculation keeps the one after its last accepted token)."""
    s = _zero_state(k, v) if state is None else state.float()
    if _triton(q, k, v, g, beta, s) and not every_state:
        return ops.recurrent_gated_delta_rule(q, k, v, g, beta, s)
    out = torch.empty_like(v)
    states = []
    for t in range(q.shape[2]):
        s = s * g[:, :, t, None, None].exp()
        predicted = (k[:, :, t, :, None] * s).sum(-2)  # S^T k: [B, H, Dv]
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (q[:, :, t, :, None] * s).sum(-2)
        if every_state:
            states.append(s)
    return out, torch.stack(states, dim=2) if every_state else s


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `recurrent_gated_delta_rule`, a chunk of tokens at a time.

    Inside a chunk, with gamma_i the cumulative log decay from the chunk's start and S0 the
    state before it, unrolling the recurrence gives

        (I + A) delta = beta * (v - exp(gamma) S0^T k),
        A_ij = beta_i exp(gamma_i - gamma_j) (k_i.k_j) for j < i (0 elsewhere),
        o_i = exp(gamma_i) S0^T q_i + sum_{j <= i} exp(gamma_i - gamma_j) (q_i.k_j) delta_j,
        S_C = exp(gamma_C) S0 + sum_j exp(gamma_C - gamma_j) k_j delta_j^T,

    so each chunk is one unit-lower-triangular solve and a few products. The sequence is
    padded to whole chunks with tokens that change nothing (g = beta = 0, zero vectors).
    """
    s = _zero_state(k, v) if state is None else state.float()
    length = q.shape[2]
    pad = -length % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    b, h, _, dk = k.shape
    chunks = (length + pad) // chunk_size
    q, k, v = (x.view(b, h, chunks, chunk_size, -1) for x in (q, k, v))
    gamma = g.view(b, h, chunks, chunk_size).cumsum(-1)
    beta = beta.view(b, h, chunks, chunk_size, 1)

    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # exp(gamma_i - gamma_j) for j <= i; masked before exp, where it could overflow.
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(later, float("-inf")).exp()
    system = (beta * k) @ k.transpose(-1, -2) * decay  # A plus its diagonal, which the solve skips
    rhs = torch.cat([beta * v, beta * gamma.exp()[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    # delta = fresh - reads @ S0: what the chunk writes once the prior state's share is known.
    fresh, reads = solved.split([v.shape[-1], dk], dim=-1)
    scores = q @ k.transpose(-1, -2) * decay  # causal within the chunk
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()

    terms = (reads, fresh, q_decayed, scores, k_to_end, chunk_decay)
    if _triton(*terms, s):
        out, s = ops.delta_rule_chunk_recurrence(*terms, s)
    else:
        out, s = _chunk_recurrence(*terms, s)
    return out.view(b, h, chunks * chunk_size, -1)[:, :, :length], s


def _chunk_recurrence(
    reads: torch.Tensor,
    fresh: torch.Tensor,
    q_decayed: torch.Tensor,
    scores: torch.Tensor,
    k_to_end: torch.Tensor,
    chunk_decay: torch.Tensor,
    s: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks one after another: each one's deltas need the state the chunks before left."""
    out = fresh.new_empty(fresh.shape)  # contiguous: `fresh` is a view into the solve's result
    for c in range(fresh.shape[2]):
        delta = fresh[:, :, c] - reads[:, :, c] @ s
        out[:, :, c] = q_decayed[:, :, c] @ s + scores[:, :, c] @ delta
        s = s * chunk_decay[:, :, c, None, None] + k_to_end[:, :, c].transpose(-1, -2) @ delta
    return out, s
