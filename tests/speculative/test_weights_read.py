"""`bench_speculative.weights_read`, the floor printed beside a step's measured cost by rows:
checked on routings whose experts are known."""

import torch

from loadtests.bench_speculative import module_bytes, weights_read
from serving.model.families import new_model
from tests.tiny_models import TINY_MOE


def _model_routing_by_token(uniform_router: bool):
    """The tiny MoE with each layer's router made to pick experts from the token alone: the
    gate reads a hidden state the embedding fixes, through a residual stream whose attention
    and experts are zeroed."""
    model = new_model({"architectures": ["Qwen3MoeForCausalLM"], **TINY_MOE}).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down.zero_()
            if uniform_router:
                layer.mlp.gate.weight.zero_()  # uniform router: top-k is always the first k
    return model


def test_one_row_is_the_unit_and_one_routing_for_all_rows_reads_no_more():
    model = _model_routing_by_token(uniform_router=True)
    ratios = weights_read(model, [list(range(40))], [1, 2, 5, 8])
    assert ratios == {1: 1.0, 2: 1.0, 5: 1.0, 8: 1.0}


def _experts_of(model, token: int) -> list[set[int]]:
    """Each layer's top-k experts for a token (alone: the hidden state depends on it only)."""
    logits: list[torch.Tensor] = []
    ids = torch.tensor([[token]])
    model(ids, torch.zeros_like(ids), padding_mask=ids >= 0, router_logits=logits)
    k = TINY_MOE["num_experts_per_tok"]
    return [set(x.reshape(-1).topk(k).indices.tolist()) for x in logits]


def test_two_tokens_that_route_apart_read_both_tokens_experts():
    """Tokens a and b whose experts differ in every layer, alternating: any window of two or
    more rows reads 2k experts a layer, a single row k."""
    model = _model_routing_by_token(uniform_router=False)
    routes = {t: _experts_of(model, t) for t in range(TINY_MOE["vocab_size"])}
    a = 0
    b = next(
        t for t in routes if all(not (x & y) for x, y in zip(routes[a], routes[t], strict=True))
    )
    experts, k = TINY_MOE["num_experts"], TINY_MOE["num_experts_per_tok"]
    mlps = [layer.mlp for layer in model.layers]
    expert = [(module_bytes(m) - module_bytes(m.gate)) / experts for m in mlps]
    dense = sum(module_bytes(layer) for layer in model.layers) - sum(expert) * experts
    ratios = weights_read(model, [[a, b] * 10], [1, 2, 5])
    expected = (dense + 2 * k * sum(expert)) / (dense + k * sum(expert))
    assert ratios[1] == 1.0
    assert abs(ratios[2] - expected) < 1e-9 and abs(ratios[5] - expected) < 1e-9
