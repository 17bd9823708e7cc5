"""Reward models: one scalar head per objective on a decoder, trained on preference pairs
with the Bradley-Terry loss, and their heads merged into one reward.

The model is transformers' `Qwen3MoeForSequenceClassification` (`Qwen3ForSequenceClassification`
for a dense decoder) with one label per objective: the decoder, a bias-free `score` projection
of its final hidden states, read at each row's last token that is not padding. Saved in that
layout, transformers loads it as it is (the test of the layout), and a row of its logits is
the objectives' rewards. A head per objective, rather than a model each, shares the decoder's
reading of an answer; each head learns only from the pairs its objective ranks (InstructGPT's
loss, Ouyang et al., 2022, per head).
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from serving.model.causal_lm import CausalLM
from serving.model.checkpoint import read_safetensors, write_directory
from serving.model.config import ModelConfig, read_config_json
from serving.model.hf_state_dict import from_hf_state_dict, to_hf_state_dict

_HEADS = {
    "Qwen3MoeForCausalLM": "Qwen3MoeForSequenceClassification",
    "Qwen3ForCausalLM": "Qwen3ForSequenceClassification",
}


class RewardModel(nn.Module):
    def __init__(self, decoder: CausalLM, objectives: list[str]) -> None:
        """`decoder`'s MTP layers are dropped: a reward reads the sequence, it drafts nothing."""
        super().__init__()
        decoder.mtp = nn.ModuleList()
        self.model = decoder
        self.objectives = list(objectives)
        self.score = nn.Linear(decoder.config.hidden_size, len(objectives), bias=False)
        nn.init.normal_(self.score.weight, std=decoder.config.hidden_size**-0.5)

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        """Each right-padded row's rewards [B, objectives], read at its last real token."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        hidden = self.model(input_ids, positions, padding_mask=padding_mask)
        last = padding_mask.long().cumsum(1).argmax(1)  # the first position of the final count
        return self.score(hidden[torch.arange(len(hidden), device=hidden.device), last]).float()


def bradley_terry_losses(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected) per pair: the chosen answer's reward above the
    rejected one's, as a probability that the pair is ranked right."""
    return -F.logsigmoid(chosen - rejected)


def merged_reward(
    rewards: torch.Tensor, objectives: list[str], weights: dict[str, float]
) -> torch.Tensor:
    """The weighted sum of the objectives' rewards [B, objectives] -> [B]; an objective
    without a weight counts 0."""
    w = torch.tensor([weights.get(name, 0.0) for name in objectives], dtype=rewards.dtype)
    return rewards @ w


def save_reward_model(model: RewardModel, path: Path, tokenizer_dir: Path | None = None) -> None:
    """transformers' sequence-classification layout, one label per objective."""
    decoder = model.model
    config = decoder.config.to_dict()
    config.pop("tierserve_mtp", None)
    config["architectures"] = [_HEADS[decoder.config.architecture]]
    config["id2label"] = dict(enumerate(model.objectives))
    config["label2id"] = {name: i for i, name in enumerate(model.objectives)}
    tensors = {k: v for k, v in to_hf_state_dict(decoder).items() if k.startswith("model.")}
    tensors["score.weight"] = model.score.weight.detach()
    write_directory(decoder, path, config, tensors, tokenizer_dir)


def load_reward_model(path: Path) -> RewardModel:
    raw = read_config_json(path / "config.json")
    heads = {v: k for k, v in _HEADS.items()}
    architecture = (raw.get("architectures") or [None])[0]
    if architecture not in heads:
        raise ValueError(f"{path}: not a reward model ({architecture!r})")
    config = ModelConfig.from_dict(raw | {"architectures": [heads[architecture]]})
    objectives = [raw["id2label"][str(i)] for i in range(len(raw["id2label"]))]
    decoder = CausalLM(config)
    hf = read_safetensors(path)
    # A classifier has no LM head; the decoder's is never read, so it may alias the embedding.
    hf.setdefault("lm_head.weight", hf["model.embed_tokens.weight"])
    decoder.load_state_dict(from_hf_state_dict(hf, decoder), strict=False)
    if config.tie_word_embeddings:
        decoder.lm_head.weight = decoder.embed_tokens.weight
    model = RewardModel(decoder, objectives)
    model.score.weight.data.copy_(hf["score.weight"])
    return model.float().eval()
