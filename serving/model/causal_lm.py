"""Qwen3-MoE and Qwen3 (dense) causal LMs in plain PyTorch, for serving and training.

Two ways to call the model:
- padded batches `[B, L]` with a padding mask and no cache (training, reference tests);
- flat token batches `[T]` with `AttentionMetadata` over a paged KV cache (the engine),
  where the cache tensors are attached to each attention module by the model runner.

Weights are held fused (`qkv_proj`, `gate_up_proj`, experts as `[E, ...]`); checkpoint I/O
maps them to and from the per-projection names of Hugging Face checkpoints.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from serving.model.attention import (
    AttentionMetadata,
    graph_decode_attention,
    paged_attention,
    write_kv,
)
from serving.model.config import ModelConfig
from serving.model.linear import Linear, pack_onednn
from serving.model.moe import DenseMLP, SparseMoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * normalize(x, self.eps)


def normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dimension in fp32, as transformers does, back in x's dtype.

    Written out rather than `F.rms_norm`, which on CPU dispatches to the same ops and more.
    """
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(eps))).to(x.dtype)


def rope_table(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, ...]:
    """cos and sin [max_positions, head_dim], computed on the CPU whatever the default device:
    the same math on `meta` (a model built before its weights load) goes through Python
    reference kernels whose first use imports for ~3 s, on every engine start."""
    cpu = torch.device("cpu")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=cpu), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        cos, sin = rope_table(head_dim, max_positions, theta)
        device = torch.get_default_device()
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> "Rope":
        """The cos/sin rows of a step's positions, looked up once for all layers."""
        flat = positions.flatten()
        cos = self.cos.index_select(0, flat).view(*positions.shape, 1, -1)
        sin = self.sin.index_select(0, flat).view(*positions.shape, 1, -1)
        return Rope(cos.to(dtype), sin.to(dtype))


@dataclass
class Rope:
    cos: torch.Tensor  # [..., 1, head_dim]
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., heads, head_dim], rotate-half convention."""
        x1, x2 = x.chunk(2, dim=-1)
        return x * self.cos + torch.cat((-x2, x1), dim=-1) * self.sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_cache: torch.Tensor | None = None  # set by the model runner
        self.v_cache: torch.Tensor | None = None
        # Set with the caches (frozen weights): q_norm's weight per query head, then
        # k_norm's per kv head, so q and k are normed and rotated as one tensor.
        self.qk_norm_weight: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        qkv = self.qkv_proj(x)
        v = qkv[..., self.q_size + self.kv_size :].view(*lead, self.num_kv_heads, self.head_dim)
        if self.qk_norm_weight is None:
            q, k = qkv[..., : self.q_size + self.kv_size].split([self.q_size, self.kv_size], -1)
            q = rope.apply(self.q_norm(q.view(*lead, self.num_heads, self.head_dim)))
            k = rope.apply(self.k_norm(k.view(*lead, self.num_kv_heads, self.head_dim)))
        else:
            heads = self.num_heads + self.num_kv_heads
            qk = qkv[..., : self.q_size + self.kv_size].view(*lead, heads, self.head_dim)
            qk = rope.apply(self.qk_norm_weight * normalize(qk, self.q_norm.eps))
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=-2)
        if meta is None:  # padded batch [B, L, heads, d], no cache
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=True,
            ).transpose(1, 2)
        elif meta.in_graph:
            o = graph_decode_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        else:
            write_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping)
            o = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(o.reshape(*lead, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = (
            SparseMoE(config)
            if config.layer_is_sparse(layer)
            else DenseMLP(config.hidden_size, config.intermediate_size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata | None,
        mask: torch.Tensor | None,
        router_logits: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, meta, mask)
        x = self.post_attention_layernorm(h)
        if isinstance(self.mlp, SparseMoE):
            return h + self.mlp(x, router_logits)
        return h + self.mlp(x)


class MTPLayer(nn.Module):
    """DeepSeek-V3 multi-token prediction: from the hidden state at t and the embedding of
    token t+1, predict token t+2 through one more decoder block and the shared head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.enorm = RMSNorm(config.hidden_size, eps)
        self.hnorm = RMSNorm(config.hidden_size, eps)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.block = DecoderLayer(config, 0)
        self.norm = RMSNorm(config.hidden_size, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        next_embeds: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.hnorm(hidden), self.enorm(next_embeds)], dim=-1))
        return self.norm(self.block(h, rope, meta, mask, None))


# What nn.Linear's and nn.Embedding's reset_parameters call.
_INIT_FUNCTIONS = ("kaiming_uniform_", "uniform_", "normal_")


def _no_init(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


class CausalLM(nn.Module):
    """`Qwen3MoeForCausalLM` (or `Qwen3ForCausalLM` when the config has no experts)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        n_mtp = config.mtp.num_layers if config.mtp else 0
        self.mtp = nn.ModuleList(MTPLayer(config) for _ in range(n_mtp))

    @classmethod
    def empty(cls, config: ModelConfig) -> "CausalLM":
        """The model on `meta`, for weights about to be loaded, without the random init
        (transformers' `no_init_weights`): init's ops on `meta` run Python reference
        kernels whose first use imports for ~3 s, on every engine start before /health."""
        skipped = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
        try:
            for name in skipped:
                setattr(nn.init, name, _no_init)
            with torch.device("meta"):
                return cls(config)
        finally:
            for name, init in skipped.items():
                setattr(nn.init, name, init)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | None = None,
        padding_mask: torch.Tensor | None = None,
        router_logits: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final hidden states (normed) for every input token.

        Padded mode: `input_ids`, `positions` `[B, L]`, `padding_mask [B, L]` True on real
        tokens. Paged mode: `[T]` tokens and `meta`. Router logits of every sparse layer are
        appended to `router_logits` when a list is given (for the load-balancing loss).
        """
        if meta is None:
            mask = causal_mask(input_ids.shape[-1], padding_mask, input_ids.device)
        else:
            mask = None
        h = self.embed_tokens(input_ids)
        rope = self.rotary(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, rope, meta, mask, router_logits)
        return self.norm(h)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """transformers' initialisation: normal(0, std) matrices, unit norms."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def mtp_logits(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        depths: int | None = None,
    ) -> list[torch.Tensor]:
        """Padded mode: MTP depth d's logits at position t predict token t + d + 1.

        Depth d combines the depth d-1 hidden state at t (depth 0: the model's final hidden
        state) with the embedding of token t + d; positions past the end see token 0 and must
        be masked by the loss. `depths` (default: one per MTP layer) past the last layer chain
        it again, as serving drafts more tokens than there are layers.
        """
        mask = causal_mask(input_ids.shape[-1], padding_mask, input_ids.device)
        out, h = [], hidden
        rope = self.rotary(positions, hidden.dtype)
        for d in range(1, (depths or len(self.mtp)) + 1):
            shifted = torch.zeros_like(input_ids)
            shifted[:, :-d] = input_ids[:, d:]
            layer = self.mtp[min(d, len(self.mtp)) - 1]
            h = layer(h, self.embed_tokens(shifted), rope, None, mask)
            out.append(self.compute_logits(h))
        return out


def pack_for_inference(model: nn.Module, decoder_layers: bool = True) -> None:
    """Lay every weight matrix out transposed in memory, logical shapes unchanged: of a
    `CausalLM` or a hybrid model (`serving/model/hybrid/`), which share these modules' names.

    `x @ W.t()` then reads `W.t()` as a plain row-major matrix, which CPU BLAS streams
    faster at decode sizes than a transposed operand (`loadtests/bench_gemm.py`).
    The embedding keeps its layout (its rows are gathered), and so does a head tied to it.
    So do the experts' stacks (3-D): inference steps of up to `moe.DENSE_OP_MAX_TOKENS`
    tokens run them in the C++ op, which reads them row-major.
    An LM head on a CPU gets a copy in oneDNN's layout instead (`pack_onednn`).
    `decoder_layers=False` leaves the decoder layers and MTP layers as checkpoints lay them
    out, for compiled decode and draft steps, which read their projections and experts in
    place, row-major (`serving/model/linear.py`, `kernels/cpu_dense.py`).
    """
    embed = model.embed_tokens.weight
    pack_onednn(model.lm_head)  # computed eagerly after every step, compiled or not
    kept = set() if decoder_layers else {*model.layers.modules(), *model.mtp.modules()}
    for module in model.modules():
        if module in kept:
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dim() == 2 and p is not embed and getattr(module, "onednn_weight", None) is None:
                packed = p.detach().transpose(-1, -2).contiguous().transpose(-1, -2)
                setattr(module, name, nn.Parameter(packed, requires_grad=False))


def causal_mask(
    length: int, padding_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """[B, 1, L, L] boolean: causal, and hiding padded keys; None where causal alone hides
    them: no padding, or each row's padding after its tokens (right padding), which no real
    token's query reaches. Attention then runs SDPA's `is_causal`, whose CPU and GPU kernels
    skip the blocks above the diagonal instead of reading a mask
    (`loadtests/bench_train_step.py`). Padded queries then see the padding before them, which
    changes only their own outputs, and every loss leaves those out.

    A fully padded query row would make softmax NaN, so each query may always see itself.
    """
    if padding_mask is None or bool((padding_mask[:, 1:] <= padding_mask[:, :-1]).all()):
        return None
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    mask = causal[None, None] & padding_mask[:, None, None, :].bool()
    return mask | torch.eye(length, dtype=torch.bool, device=device)[None, None]
