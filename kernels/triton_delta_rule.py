"""The gated delta rule of Gated DeltaNet layers in Triton: the token-by-token recurrence that
decodes, and the chunk-to-chunk recurrence of the chunked form that prefills.

Both keep a program's tile of the state S [Dk, Dv] (fp32, one tile of value columns per
program, one program per (sequence, head, tile)) in registers across the whole sequence, so
the state is read and written once per call, where the PyTorch form launches several kernels
per token or per chunk and moves the state through memory each time. Value columns never mix
in the recurrence (S's columns evolve independently), which is what lets the value dimension
split across programs.

In the chunked form the work inside each chunk (one triangular solve and a few products for
every chunk at once, `serving/model/hybrid/delta_rule.py`) is batched PyTorch; only the part
that is sequential runs here: per chunk, the deltas from the state before it, the chunk's
outputs, and the state after it, as three products on the state tile. Products are fp32 in
IEEE precision, not TF32: the state sums a whole context.

Tested against the PyTorch forms (tests/kernels/test_delta_rule_kernels.py) under
`TRITON_INTERPRET=1` on a CPU.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _state_tile(state_ptr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_V: tl.constexpr):  # fmt: skip
    """This program's tile of its (sequence, head)'s state: all key rows, a tile of value
    columns; with the offsets and mask that store it back, and the key and value indices."""
    keys = tl.arange(0, BLOCK_K)
    values = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    tile = tl.program_id(0) * DK * DV + keys[:, None] * DV + values[None, :]
    tile_ok = (keys < DK)[:, None] & (values < DV)[None, :]
    return tl.load(state_ptr + tile, mask=tile_ok, other=0.0), tile, tile_ok, keys, values


@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    out_ptr,
    length,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq_head = tl.program_id(0)
    s, tile, tile_ok, keys, values = _state_tile(state_ptr, DK, DV, BLOCK_K, BLOCK_V)
    key_ok, value_ok = keys < DK, values < DV
    for t in range(length):
        token = seq_head * length + t
        k = tl.load(k_ptr + token * DK + keys, mask=key_ok, other=0.0)
        q = tl.load(q_ptr + token * DK + keys, mask=key_ok, other=0.0)
        v = tl.load(v_ptr + token * DV + values, mask=value_ok, other=0.0)
        s = s * tl.exp(tl.load(g_ptr + token))
        predicted = tl.sum(k[:, None] * s, axis=0)  # S^T k
        delta = tl.load(beta_ptr + token) * (v - predicted)
        s = s + k[:, None] * delta[None, :]
        tl.store(out_ptr + token * DV + values, tl.sum(q[:, None] * s, axis=0), mask=value_ok)
    tl.store(state_ptr + tile, s, mask=tile_ok)


@triton.jit
def _chunk_kernel(
    reads_ptr,
    fresh_ptr,
    q_decayed_ptr,
    scores_ptr,
    k_to_end_ptr,
    chunk_decay_ptr,
    state_ptr,
    out_ptr,
    chunks,
    DK: tl.constexpr,
    DV: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq_head = tl.program_id(0)
    rows = tl.arange(0, CHUNK)
    s, tile, tile_ok, keys, values = _state_tile(state_ptr, DK, DV, BLOCK_K, BLOCK_V)
    key_ok, value_ok = keys < DK, values < DV
    for c in range(chunks):
        chunk = seq_head * chunks + c
        by_key = chunk * CHUNK * DK + rows[:, None] * DK + keys[None, :]
        by_value = chunk * CHUNK * DV + rows[:, None] * DV + values[None, :]
        reads = tl.load(reads_ptr + by_key, mask=key_ok[None, :], other=0.0)
        fresh = tl.load(fresh_ptr + by_value, mask=value_ok[None, :], other=0.0)
        delta = fresh - tl.dot(reads, s, input_precision="ieee")
        q_decayed = tl.load(q_decayed_ptr + by_key, mask=key_ok[None, :], other=0.0)
        scores = tl.load(scores_ptr + chunk * CHUNK * CHUNK + rows[:, None] * CHUNK + rows[None, :])
        out = tl.dot(q_decayed, s, input_precision="ieee")
        out += tl.dot(scores, delta, input_precision="ieee")
        tl.store(out_ptr + by_value, out, mask=value_ok[None, :])
        k_to_end = tl.load(k_to_end_ptr + by_key, mask=key_ok[None, :], other=0.0)
        s = s * tl.load(chunk_decay_ptr + chunk)
        s += tl.dot(tl.trans(k_to_end), delta, input_precision="ieee")
    tl.store(state_ptr + tile, s, mask=tile_ok)


def _blocks(dk: int, dv: int) -> tuple[int, int, int]:
    """Tile sizes: every key row at once (tl.dot needs 16 or more), value columns in tiles of
    up to 64, and how many tiles."""
    block_k = max(16, triton.next_power_of_2(dk))
    block_v = min(64, max(16, triton.next_power_of_2(dv)))
    return block_k, block_v, triton.cdiv(dv, block_v)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, L, Dk], v [B, H, L, Dv], g, beta [B, H, L], state [B, H, Dk, Dv], all fp32
    -> outputs [B, H, L, Dv] and the state after the last token (a new tensor)."""
    b, h, length, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    state = state.float().contiguous().clone()
    out = torch.empty_like(v)
    block_k, block_v, tiles = _blocks(dk, dv)
    _recurrent_kernel[(b * h, tiles)](
        q, k, v, g, beta, state, out, length, dk, dv, block_k, block_v
    )  # fmt: skip
    return out, state


def chunk_recurrence(
    reads: torch.Tensor,
    fresh: torch.Tensor,
    q_decayed: torch.Tensor,
    scores: torch.Tensor,
    k_to_end: torch.Tensor,
    chunk_decay: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form's sequential part (`chunked_gated_delta_rule`'s terms): per chunk c,
    delta = fresh_c - reads_c S, out_c = q_decayed_c S + scores_c delta,
    S <- chunk_decay_c S + k_to_end_c^T delta. Shapes [B, H, N, C, Dk or Dv or C] and
    chunk_decay [B, H, N]; the chunk size C a power of two of 16 or more. Returns the outputs
    [B, H, N, C, Dv] and the final state (a new tensor)."""
    b, h, chunks, chunk, dk = reads.shape
    dv = fresh.shape[-1]
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"the chunk size must be a power of two of 16 or more, not {chunk}")
    parts = (reads, fresh, q_decayed, scores, k_to_end, chunk_decay)
    reads, fresh, q_decayed, scores, k_to_end, chunk_decay = (p.float().contiguous() for p in parts)
    state = state.float().contiguous().clone()
    out = torch.empty_like(fresh)
    block_k, block_v, tiles = _blocks(dk, dv)
    _chunk_kernel[(b * h, tiles)](
        reads, fresh, q_decayed, scores, k_to_end, chunk_decay, state, out, chunks,
        dk, dv, chunk, block_k, block_v,
    )  # fmt: skip
    return out, state
