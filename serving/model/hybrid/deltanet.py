"""Gated DeltaNet, Qwen3-Next's linear-attention layer.

Its memory of the past is a fixed-size matrix per value head, updated by the gated delta rule
(`delta_rule.py`), plus a short depthwise causal convolution over the projected queries, keys
and values. That is what lets three of every four layers reach long contexts at constant cost
per token.

Checkpoints interleave the input projections per key-head group: `in_proj_qkvz` holds, for
each key head, its query, its key, then the values and output gates of the value heads it
serves; `in_proj_ba` likewise the write strengths (b) and decay inputs (a). The layout is
kept as stored and taken apart here, so weights load without reshuffling.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from serving.model.hybrid.batch import SlotGroup
from serving.model.hybrid.config import HybridConfig
from serving.model.hybrid.delta_rule import (
    chunked_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from serving.model.hybrid.norms import GatedRMSNorm
from serving.model.hybrid.state import LinearState
from serving.model.linear import Linear


class GatedDeltaNet(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.key_heads = config.linear_num_key_heads
        self.value_heads = config.linear_num_value_heads
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        self.group = self.value_heads // self.key_heads  # value heads per key head
        self.key_dim = self.key_heads * self.key_head_dim
        self.value_dim = self.value_heads * self.value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        self.conv_dim = config.conv_dim
        hidden = config.hidden_size
        self.in_proj_qkvz = Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = Linear(hidden, 2 * self.value_heads, bias=False)
        # Depthwise: one filter of `kernel` taps per channel, [conv_dim, 1, kernel] as stored.
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_head_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, hidden, bias=False)
        # The engine's per-sequence states, [slots, ...] (`slots.py`); None outside the engine.
        self.conv_slots: torch.Tensor | None = None
        self.recurrent_slots: torch.Tensor | None = None
        # By slot, the state after each token of the slot's last verify step (`forward_slots`).
        self.verify_states: dict[int, LinearState] = {}

    def forward(
        self,
        x: torch.Tensor,
        token_mask: torch.Tensor | None,
        lengths: torch.Tensor,
        state: LinearState | None,
        every_state: bool = False,
    ) -> tuple[torch.Tensor, LinearState | None]:
        """x [B, L, hidden] -> [B, L, hidden], and the state after each row's last real token
        when a state is given (a call without one starts from zeros and keeps none); with
        `every_state`, the state after each token, its tensors with a dimension L after B
        (rows without padding: the engine's verify steps).

        `token_mask` [B, L] is True on real tokens (None: no padding), `lengths` [B] counts
        them; rows are right-padded (`batch.PaddedBatch`)."""
        b, length, _ = x.shape
        dk, dv, g_ = self.key_head_dim, self.value_head_dim, self.group
        qkvz = self.in_proj_qkvz(x).view(b, length, self.key_heads, -1)
        q, k, v, z = qkvz.split([dk, dk, g_ * dv, g_ * dv], dim=-1)
        beta_in, decay_in = self.in_proj_ba(x).view(b, length, self.key_heads, -1).chunk(2, -1)
        mixed = torch.cat([t.reshape(b, length, -1) for t in (q, k, v)], dim=-1).transpose(1, 2)

        if state is None:
            history = mixed.new_zeros(b, self.conv_dim, self.kernel - 1)
        else:
            history = state.conv.to(mixed.dtype)
        window = torch.cat([history, mixed], dim=-1)  # [B, conv_dim, kernel - 1 + L]
        conv = F.silu(F.conv1d(window, self.conv1d.weight, groups=self.conv_dim))
        q, k, v = conv.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], -1)

        beta = beta_in.reshape(b, length, self.value_heads).sigmoid().float()
        # Decay in log space, <= 0: -exp(A_log) * softplus(a + dt_bias), in fp32 whatever the
        # weights' dtype (a half-precision exp(A_log) can overflow).
        g = -self.A_log.float().exp() * F.softplus(
            decay_in.reshape(b, length, self.value_heads).float() + self.dt_bias.float()
        )
        if token_mask is not None:  # padding leaves the recurrent state as it was
            keep = token_mask[:, :, None]
            g, beta = g * keep, beta * keep

        def heads(t: torch.Tensor, dim: int) -> torch.Tensor:  # [B, L, n * dim] -> [B, n, L, dim]
            return t.reshape(b, length, -1, dim).transpose(1, 2).float()

        # Each query/key head serves `group` consecutive value heads.
        q = l2_normalize(heads(q, dk)).repeat_interleave(g_, dim=1) * dk**-0.5
        k = l2_normalize(heads(k, dk)).repeat_interleave(g_, dim=1)
        rule = recurrent_gated_delta_rule if length == 1 else chunked_gated_delta_rule
        if every_state:
            rule = functools.partial(recurrent_gated_delta_rule, every_state=True)
        out, recurrent = rule(
            q, k, heads(v, dv), g.transpose(1, 2), beta.transpose(1, 2),
            None if state is None else state.recurrent,
        )  # fmt: skip
        out = out.transpose(1, 2).to(x.dtype)  # [B, L, value_heads, dv]
        out = self.norm(out, z.reshape(b, length, self.value_heads, dv))
        y = self.out_proj(out.reshape(b, length, self.value_dim))
        if state is None:
            return y, None
        if every_state:
            tails = [
                self._conv_tail(window, torch.full_like(lengths, t + 1)) for t in range(length)
            ]
            return y, LinearState(torch.stack(tails, 1), recurrent.transpose(1, 2))
        return y, LinearState(self._conv_tail(window, lengths), recurrent)

    def forward_slots(self, x: torch.Tensor, groups: list[SlotGroup]) -> torch.Tensor:
        """The engine's form: a step's tokens x [T, hidden] -> [T, hidden], each group starting
        from the states in its slots (`conv_slots`, `recurrent_slots`, attached by the engine,
        `slots.py`) and leaving its new states there."""
        out = torch.empty_like(x)
        for g in groups:
            end = g.offset + g.rows * g.length
            state = LinearState(self.conv_slots[g.slots], self.recurrent_slots[g.slots])
            y, state = self.forward(
                x[g.offset : end].view(g.rows, g.length, -1), None, g.lengths, state,
                every_state=g.verify,
            )  # fmt: skip
            if g.verify:  # every draft position's state, for `keep_verified`; the last one now
                for row, slot in enumerate(g.slots.tolist()):
                    self.verify_states[slot] = LinearState(state.conv[row], state.recurrent[row])
                state = LinearState(state.conv[:, -1], state.recurrent[:, -1])
            self.conv_slots.index_copy_(0, g.slots, state.conv.to(self.conv_slots.dtype))
            self.recurrent_slots.index_copy_(0, g.slots, state.recurrent)
            out[g.offset : end] = y.view(-1, y.shape[-1])
        return out

    def keep_verified(self, slot: int, tokens: int) -> None:
        """Give `slot` the state after the first `tokens` tokens of its last verify step:
        a DeltaNet state cannot drop rejected drafts the way a KV cache overwrites them."""
        states = self.verify_states.pop(slot)
        self.conv_slots[slot] = states.conv[tokens - 1]
        self.recurrent_slots[slot] = states.recurrent[tokens - 1]

    def _conv_tail(self, window: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The last `kernel - 1` inputs up to each row's last real token: row b's tail ends at
        window column lengths[b] + kernel - 2."""
        index = lengths[:, None] + torch.arange(self.kernel - 1, device=window.device)
        return window.gather(-1, index[:, None, :].expand(-1, self.conv_dim, -1))
