import pytest
import torch

from serving.model.causal_lm import CausalLM, causal_mask
from serving.model.checkpoint import load_checkpoint, save_checkpoint
from serving.model.config import ModelConfig
from tests.tiny_models import TINY_MOE
from training.config import ConfigError
from training.stages.pruning import keep_layers


@pytest.fixture()
def model() -> CausalLM:
    raw = dict(
        TINY_MOE,
        architectures=["Qwen3MoeForCausalLM"],
        num_hidden_layers=4,
        mlp_only_layers=[2],
        tierserve_mtp={"num_layers": 1},
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict(raw))
    model.init_weights(std=0.2)
    return model.eval()


def test_the_student_runs_the_kept_layers_of_the_model(model: CausalLM, tmp_path) -> None:
    student = keep_layers(model, [0, 2, 3])
    assert student.config.num_hidden_layers == 3
    assert student.config.mlp_only_layers == [1]  # layer 2 was dense and is now layer 1
    assert student.lm_head.weight is student.embed_tokens.weight
    ids = torch.randint(0, TINY_MOE["vocab_size"], (2, 12))
    positions = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        expected = model.embed_tokens(ids)
        rope = model.rotary(positions, expected.dtype)
        mask = causal_mask(12, None, ids.device)
        for i in (0, 2, 3):
            expected = model.layers[i](expected, rope, None, mask, None)
        expected = model.compute_logits(model.norm(expected))
        logits = student.compute_logits(student(ids, positions))
    torch.testing.assert_close(logits, expected)
    torch.testing.assert_close(student.mtp[0].eh_proj.weight, model.mtp[0].eh_proj.weight)
    save_checkpoint(student, tmp_path / "student")
    reloaded = load_checkpoint(tmp_path / "student")
    with torch.no_grad():
        torch.testing.assert_close(reloaded.compute_logits(reloaded(ids, positions)), logits)


@pytest.mark.parametrize("layers", [[], [0, 0], [4], [-1]])
def test_layers_that_are_not_distinct_layers_of_the_model_are_refused(
    model: CausalLM, layers: list[int]
) -> None:
    with pytest.raises(ConfigError, match="distinct layers"):
        keep_layers(model, layers)
