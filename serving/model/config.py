"""Model configuration: the subset of a Hugging Face `config.json` that our model runs."""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM")


class CheckpointError(ValueError):
    """A checkpoint directory that we cannot serve: missing, malformed or unsupported."""


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A checkpoint's config.json as a dict, or a CheckpointError that says what is wrong."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: config.json not found") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: config.json must hold a JSON object")
    return raw


@dataclass
class MTPConfig:
    """DeepSeek-V3-style multi-token prediction: extra blocks predicting token t+2.

    Stored in config.json under `tierserve_mtp` so transformers ignores it.
    """

    num_layers: int = 1


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # MoE fields (Qwen3MoeForCausalLM only; num_experts == 0 means dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001
    mtp: MTPConfig | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # config.json's `quantization_config` (FP4 checkpoints, `serving/model/quantization.py`)
    quantization: dict[str, Any] | None = None
    dtype: str | None = None  # the weights' dtype as saved (`--dtype auto` computes in it)

    @property
    def is_moe(self) -> bool:
        return self.architecture == "Qwen3MoeForCausalLM" and self.num_experts > 0

    def layer_is_sparse(self, layer: int) -> bool:
        """The rule of transformers' Qwen3MoeDecoderLayer."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"unsupported architecture {arch!r}; "
                f"tierserve serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise CheckpointError(f"unsupported rope_type {rope.get('rope_type')!r}")
        if raw.get("use_sliding_window"):
            raise CheckpointError("sliding-window attention is not supported")
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            is_moe = arch == "Qwen3MoeForCausalLM"
            mtp = raw.get("tierserve_mtp")
            cfg = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                num_experts=int(raw.get("num_experts", raw.get("num_local_experts", 0)))
                if is_moe
                else 0,
                num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)) if is_moe else 0,
                moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)) if is_moe else 0,
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
                mlp_only_layers=[int(i) for i in raw.get("mlp_only_layers") or []],
                router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
                mtp=MTPConfig(**mtp) if mtp else None,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=raw.get("eos_token_id"),
                pad_token_id=raw.get("pad_token_id"),
                quantization=raw.get("quantization_config"),
                dtype=raw.get("dtype") or raw.get("torch_dtype"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"malformed config.json: {e!r}") from e
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported hidden_act {raw.get('hidden_act')!r}")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")
        if cfg.is_moe and not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise CheckpointError("num_experts_per_tok must be in [1, num_experts]")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(read_config_json(path))

    def to_dict(self) -> dict[str, Any]:
        """config.json as transformers writes it for this architecture."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen3_moe" if self.architecture == "Qwen3MoeForCausalLM" else "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "use_sliding_window": False,
            "sliding_window": None,
            "dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.architecture == "Qwen3MoeForCausalLM":
            out |= {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": self.mlp_only_layers,
                "router_aux_loss_coef": self.router_aux_loss_coef,
            }
        if self.mtp is not None:
            out["tierserve_mtp"] = asdict(self.mtp)
        if self.quantization is not None:
            out["quantization_config"] = self.quantization
        return out
