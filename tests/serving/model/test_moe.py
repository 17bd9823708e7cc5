"""The experts' forms against each other: a one-row compiled decode step's (`gathered_experts`),
an inference step's of up to `DENSE_OP_MAX_TOKENS` tokens (the dense C++ op), and the grouped
form that training and longer steps run."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import cpu_dense
from serving.model import moe
from serving.model.causal_lm import CausalLM, pack_for_inference
from serving.model.config import ModelConfig
from serving.model.moe import DENSE_OP_MAX_TOKENS, gathered_experts, grouped_experts, route
from tests.tiny_models import TINY_MOE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_gathered_experts_match_the_grouped_experts(dtype: torch.dtype, tokens: int):
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 8, 64, 48, 2
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, True)
    expected = grouped_experts(x, weights, ids, gate_up, down)
    got = gathered_experts(x, weights, ids, gate_up, down)
    assert got.dtype == dtype and got.shape == x.shape
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), expected.float(), **tol)
    # Compiled, as a decode graph runs it: the same numbers.
    compiled = torch.compile(gathered_experts, dynamic=False, fullgraph=True)
    torch.testing.assert_close(compiled(x, weights, ids, gate_up, down).float(), got.float(), **tol)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tokens", [2, 24, 64, 300])
def test_grouped_experts_match_each_token_alone(threads: int, tokens: int):
    """Both of the grouped experts' forms, the batched product over padded slices (small
    batches; on two threads, up to a few hundred tokens) and one product per expert, against
    each token running its experts alone."""
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 8, 64, 48, 2
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    down = torch.randn(experts, hidden, inter, generator=g) * 0.2
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, True)
    expected = torch.cat(
        [
            grouped_experts(x[t : t + 1], weights[t : t + 1], ids[t : t + 1], gate_up, down)
            for t in range(tokens)
        ]
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = grouped_experts(x, weights, ids, gate_up, down)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_inference_steps_run_their_experts_in_the_dense_op_up_to_its_limit(monkeypatch):
    """In an engine's model (its weights as `pack_for_inference` leaves them), an inference step
    of up to `DENSE_OP_MAX_TOKENS` tokens runs the dense op, eager as compiled; more tokens and
    training steps the grouped form; each equal to the grouped form."""
    config = ModelConfig.from_dict({**TINY_MOE, "architectures": ["Qwen3MoeForCausalLM"]})
    model = CausalLM(config)
    model.init_weights()
    pack_for_inference(model.eval())
    layer = model.layers[0].mlp
    assert (
        layer.gate_up.is_contiguous() and layer.down.is_contiguous()
    )  # row-major, as the op reads
    tokens_in_op: list[int] = []
    op = cpu_dense.dense_moe
    monkeypatch.setattr(
        cpu_dense, "dense_moe", lambda x, *rest: tokens_in_op.append(len(x)) or op(x, *rest)
    )
    g = torch.Generator().manual_seed(0)
    for tokens, training in [(2, False), (DENSE_OP_MAX_TOKENS, False), (65, False), (8, True)]:
        x = torch.randn(tokens, config.hidden_size, generator=g)
        with torch.set_grad_enabled(training):
            got = layer(x)
            weights, ids = route(layer.gate(x), layer.top_k, layer.norm_topk_prob)
            want = grouped_experts(x, weights, ids, layer.gate_up, layer.down)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert tokens_in_op == [2, DENSE_OP_MAX_TOKENS]


class ProductShapes(TorchDispatchMode):
    """The [rows, K] shapes of the first operands of the matrix products run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("autocast", [False, True])
def test_a_half_precision_training_step_pads_the_expert_slices(monkeypatch, autocast: bool):
    """Under bf16 autocast (or in bf16), with gradients, each expert's products run over its
    slice padded to `TRAINING_SEGMENT_ROWS` (the shapes recur, so oneDNN builds no new
    kernel), and the outputs and gradients are those of the exact slices; fp32 is not padded."""
    g = torch.Generator().manual_seed(0)
    experts, hidden, inter, top_k, tokens = 8, 64, 48, 2, 1000  # past the batched form
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).requires_grad_()
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.2).requires_grad_()
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, True)
    if not autocast:
        x, weights = x.bfloat16(), weights.bfloat16()

    def step() -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast), ProductShapes() as seen:
            y = grouped_experts(x, weights, ids, gate_up, down)
        grads = torch.autograd.grad(y.float().square().sum(), [gate_up, down])
        return y, seen.rows, grads

    y, rows, grads = step()
    assert rows and all(r % moe.TRAINING_SEGMENT_ROWS == 0 for r in rows)
    monkeypatch.setattr(moe, "TRAINING_SEGMENT_ROWS", 1)
    exact_y, exact_rows, exact_grads = step()
    assert sum(exact_rows) == 2 * tokens * top_k  # gate_up and down over every slot
    torch.testing.assert_close(y, exact_y, rtol=1e-2, atol=1e-2)
    for got, want in zip(grads, exact_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    with ProductShapes() as seen:  # fp32, with gradients: exact slices
        grouped_experts(x.float(), weights.float(), ids, gate_up, down)
    assert sum(seen.rows) == 2 * tokens * top_k
