"""Configuration of a hybrid-attention model: the subset of a Qwen3-Next `config.json` we run.

Qwen3-Next interleaves Gated DeltaNet layers (linear attention, a fixed-size state per
sequence) with gated full-attention layers. Which layer is which comes from `layer_types`, or,
in configs that predate it, from `full_attention_interval`: every interval-th layer attends in
full (transformers' rule).
"""

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from serving.model.config import CheckpointError, read_config_json

ARCHITECTURE = "Qwen3NextForCausalLM"
MODEL_TYPE = "qwen3_next"
LINEAR = "linear_attention"
FULL = "full_attention"


def is_hybrid_checkpoint(path: str | Path) -> bool:
    """Whether a checkpoint directory holds a Qwen3-Next model (by its config.json), which the
    engine loads with `load_hybrid_checkpoint` rather than as the MoE family."""
    return is_hybrid_config(read_config_json(Path(path) / "config.json"))


def is_hybrid_config(raw: dict[str, Any]) -> bool:
    """Whether config.json fields `raw` describe a Qwen3-Next model."""
    archs = raw.get("architectures") or []
    return (archs[0] if archs else None) == ARCHITECTURE or raw.get("model_type") == MODEL_TYPE


@dataclass
class HybridConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: list[str]
    # Full-attention layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    # Gated DeltaNet layers
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # Sparse MoE with a shared expert (num_experts == 0: every MLP dense); the names are those
    # `serving.model.moe.SparseMoE` reads, so the routed part is built by it.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    dtype: str | None = None

    @property
    def rotary_dim(self) -> int:
        """The leading part of each head that RoPE rotates; the rest passes through."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        """Channels of the DeltaNet's causal convolution: queries, keys and values."""
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def is_moe(self) -> bool:
        """Whether any layer routes to experts (the trainer adds the router losses)."""
        return any(self.layer_is_sparse(i) for i in range(self.num_hidden_layers))

    def layer_is_sparse(self, layer: int) -> bool:
        """The rule of transformers' Qwen3NextDecoderLayer."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "HybridConfig":
        archs = raw.get("architectures") or []
        if (archs[0] if archs else None) != ARCHITECTURE and raw.get("model_type") != MODEL_TYPE:
            raise CheckpointError(f"not a {MODEL_TYPE} config: architectures {archs!r}")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise CheckpointError(f"unsupported rope_type {rope.get('rope_type')!r}")
        if raw.get("quantization_config") is not None:
            raise CheckpointError("quantized Qwen3-Next checkpoints are not supported yet")
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported hidden_act {raw.get('hidden_act')!r}")
        try:
            layers = int(raw["num_hidden_layers"])
            heads = int(raw["num_attention_heads"])
            cfg = cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=layers,
                layer_types=_layer_types(raw, layers),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                partial_rotary_factor=float(
                    rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
                ),
                max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                linear_num_key_heads=int(raw["linear_num_key_heads"]),
                linear_num_value_heads=int(raw["linear_num_value_heads"]),
                linear_key_head_dim=int(raw["linear_key_head_dim"]),
                linear_value_head_dim=int(raw["linear_value_head_dim"]),
                linear_conv_kernel_dim=int(raw.get("linear_conv_kernel_dim", 4)),
                num_experts=int(raw.get("num_experts", 0)),
                num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)),
                moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
                shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size", 0)),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
                mlp_only_layers=[int(i) for i in raw.get("mlp_only_layers") or []],
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=raw.get("eos_token_id"),
                pad_token_id=raw.get("pad_token_id"),
                dtype=raw.get("dtype") or raw.get("torch_dtype"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"malformed config.json: {e!r}") from e
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise CheckpointError(
                "linear_num_value_heads must be a multiple of linear_num_key_heads"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise CheckpointError(
                f"partial_rotary_factor {self.partial_rotary_factor} gives an invalid rotary "
                f"dimension {self.rotary_dim} of head_dim {self.head_dim}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise CheckpointError("num_experts_per_tok must be in [1, num_experts]")

    def to_dict(self) -> dict[str, Any]:
        """The config.json that transformers' `Qwen3NextConfig` reads and `from_dict` reads
        back: RoPE's fields under `rope_parameters`, as transformers writes them."""
        raw = asdict(self)
        rope = {
            "rope_type": "default",
            "rope_theta": raw.pop("rope_theta"),
            "partial_rotary_factor": raw.pop("partial_rotary_factor"),
        }
        return {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "hidden_act": "silu",
            "rope_parameters": rope,
            **raw,
        }

    @classmethod
    def from_file(cls, path: str | Path) -> "HybridConfig":
        return cls.from_dict(read_config_json(path))


def _layer_types(raw: dict[str, Any], layers: int) -> list[str]:
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval", 4))
        return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    if len(types) != layers or not set(types) <= {LINEAR, FULL}:
        raise CheckpointError(
            f"layer_types must name {layers} layers, each {LINEAR!r} or {FULL!r}: {types!r}"
        )
    return list(types)
