"""Qwen3-Next (`Qwen3NextForCausalLM`) in plain PyTorch: hybrid attention over a padded batch.

Decoder layers are pre-norm residual blocks as in Qwen3-MoE, whose token mixer is either a
Gated DeltaNet (`deltanet.py`) or gated full attention (`gated_attention.py`), per the config's
`layer_types`, and whose MLP is a sparse MoE with a shared expert or a dense MLP.

One forward serves training and reference checks (no state) and prefill then decode (a
`HybridState` in, the next one out): calling it on a prefix and then token by token computes
what one call over the whole sequence does. The engine calls `forward_paged` instead, over
its paged KV cache and DeltaNet state slots, with the same layers.
"""

import torch
from torch import nn

from serving.model.attention import AttentionMetadata
from serving.model.causal_lm import Rope, RotaryEmbedding
from serving.model.hybrid.batch import PaddedBatch, SlotGroup
from serving.model.hybrid.config import LINEAR, HybridConfig
from serving.model.hybrid.deltanet import GatedDeltaNet
from serving.model.hybrid.gated_attention import GatedAttention
from serving.model.hybrid.norms import ZeroCentredRMSNorm
from serving.model.hybrid.shared_moe import SharedExpertMoE, hybrid_mlp
from serving.model.hybrid.state import HybridState, KVState, LinearState
from serving.model.linear import Linear


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: HybridConfig, layer: int) -> None:
        super().__init__()
        self.is_linear = config.layer_types[layer] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = hybrid_mlp(config, layer)
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        rope: Rope,
        batch: PaddedBatch,
        state: LinearState | KVState | None,
        router_logits: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, LinearState | KVState | None]:
        x = self.input_layernorm(h)
        if self.is_linear:
            mixed, state = self.linear_attn(x, batch.token_mask, batch.lengths, state)
        else:
            mixed, state = self.self_attn(x, rope, batch, state)
        return self._mlp(h + mixed, router_logits), state

    def forward_paged(
        self, h: torch.Tensor, rope: Rope, meta: AttentionMetadata, groups: list[SlotGroup]
    ) -> torch.Tensor:
        """The engine's form: a step's flat tokens [T, hidden], full attention over the paged
        KV cache, DeltaNet from the sequences' state slots."""
        x = self.input_layernorm(h)
        if self.is_linear:
            mixed = self.linear_attn.forward_slots(x, groups)
        else:
            mixed = self.self_attn.forward_paged(x, rope, meta)
        return self._mlp(h + mixed, None)

    def _mlp(self, h: torch.Tensor, router_logits: list[torch.Tensor] | None) -> torch.Tensor:
        x = self.post_attention_layernorm(h)
        if isinstance(self.mlp, SharedExpertMoE):
            return h + self.mlp(x, router_logits)
        return h + self.mlp(x)


class HybridCausalLM(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(
            config.rotary_dim, config.max_position_embeddings, config.rope_theta
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """transformers' initialisation of this architecture: normal(0, std) matrices, the
        zero-centred norms at 0 (a scale of 1), the DeltaNet's gated norm at 1, its decay
        rates `exp(A_log)` uniform in (0.01, 16) and `dt_bias` at 1."""
        for name, p in self.named_parameters():
            if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
                p.fill_(1.0)
            elif name.endswith("norm.weight"):
                p.zero_()
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 16).log())
            else:
                p.normal_(0.0, std)

    def empty_state(self, batch: int) -> HybridState:
        """The state of `batch` new sequences, in the model's dtype and on its device."""
        w = self.embed_tokens.weight
        return HybridState.empty(self.config, batch, w.dtype, w.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        state: HybridState | None = None,
        router_logits: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, HybridState | None]:
        """Final hidden states (normed) [B, L, hidden] for `input_ids` [B, L], and the state
        after each row's last real token when `state` is given.

        `padding_mask` [B, L] is True on real tokens, which come first in each row. Row b's
        tokens continue `state`'s sequence b (positions from `state.lengths`); without a state
        they start new sequences. Router logits of every sparse layer are appended to
        `router_logits` when a list is given.
        """
        past_width = 0
        if state is not None:
            kv = [s for s in state.layers if isinstance(s, KVState)]
            past_width = kv[0].keys.shape[2] if kv else 0
        batch = PaddedBatch.build(
            input_ids, padding_mask, None if state is None else state.lengths, past_width
        )
        h = self.embed_tokens(input_ids)
        rope = self.rotary(batch.positions, h.dtype)
        layer_states = []
        for i, layer in enumerate(self.layers):
            h, s = layer(h, rope, batch, None if state is None else state.layers[i], router_logits)
            layer_states.append(s)
        h = self.norm(h)
        if state is None:
            return h, None
        return h, HybridState(state.lengths + batch.lengths, layer_states)

    def forward_paged(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        groups: list[SlotGroup],
    ) -> torch.Tensor:
        """Final hidden states (normed) [T, hidden] of a step's flat tokens `input_ids` [T] at
        `positions` [T], laid out as `meta` and `groups` say (`serving/model/hybrid/paged.py`)."""
        h = self.embed_tokens(input_ids)
        rope = self.rotary(positions, h.dtype)
        for layer in self.layers:
            h = layer.forward_paged(h, rope, meta, groups)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
