"""The gated delta rule's two forms against each other and against transformers' PyTorch
reference (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`)."""

import pytest
import torch

from kernels import ops
from serving.model.hybrid.delta_rule import (
    chunked_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

B, H, DK, DV = 2, 4, 16, 8


def _inputs(length: int, seed: int = 0):
    """q and k normalised (q scaled) as the layer hands them over; decays spread over
    (-3, 0] so some heads forget within a chunk and some barely at all."""
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, H, length, DK, generator=g)) * DK**-0.5
    k = l2_normalize(torch.randn(B, H, length, DK, generator=g))
    v = torch.randn(B, H, length, DV, generator=g)
    decay = -3 * torch.rand(B, H, length, generator=g)
    beta = torch.rand(B, H, length, generator=g)
    state = torch.randn(B, H, DK, DV, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize(("length", "chunk"), [(1, 64), (37, 16), (64, 64), (150, 64)])
def test_chunked_equals_recurrent(length, chunk):
    q, k, v, g, beta, s0 = _inputs(length)
    o1, s1 = chunked_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk)
    o2, s2 = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert (o1 - o2).abs().max() <= 1e-5
    assert (s1 - s2).abs().max() <= 1e-5


def test_both_forms_match_transformers():
    """transformers' functions take [B, L, H, D], normalise q and k themselves and scale q."""
    length = 100
    gen = torch.Generator().manual_seed(3)
    raw_q, raw_k = (torch.randn(B, H, length, DK, generator=gen) for _ in range(2))
    _, _, v, g, beta, s0 = _inputs(length, seed=3)
    q, k = l2_normalize(raw_q) * DK**-0.5, l2_normalize(raw_k)

    def t(x):
        return x.transpose(1, 2)

    ref_args = (t(raw_q), t(raw_k), t(v), t(g), t(beta))
    ref_kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_o, ref_s = qwen3_next.torch_chunk_gated_delta_rule(*ref_args, **ref_kw)
    o, s = chunked_gated_delta_rule(q, k, v, g, beta, s0)
    assert (o - t(ref_o)).abs().max() <= 1e-5
    assert (s - ref_s).abs().max() <= 1e-5
    ref_o, ref_s = qwen3_next.torch_recurrent_gated_delta_rule(*ref_args, **ref_kw)
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert (o - t(ref_o)).abs().max() <= 1e-5
    assert (s - ref_s).abs().max() <= 1e-5


def test_split_sequence_continues_through_the_state():
    """A chunked prefix, then a chunked middle, then single steps: the one long recurrence."""
    q, k, v, g, beta, s0 = _inputs(90, seed=1)
    whole, end = chunked_gated_delta_rule(q, k, v, g, beta, s0)
    parts, s = [], s0
    for lo, hi in [(0, 40), (40, 83)] + [(i, i + 1) for i in range(83, 90)]:
        sl = slice(lo, hi)
        rule = recurrent_gated_delta_rule if hi - lo == 1 else chunked_gated_delta_rule
        o, s = rule(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl], s)
        parts.append(o)
    assert (torch.cat(parts, dim=2) - whole).abs().max() <= 1e-5
    assert (s - end).abs().max() <= 1e-5


def test_tokens_without_decay_or_write_leave_the_state():
    """How padding passes through a layer: g = 0 and beta = 0 change nothing."""
    q, k, v, g, beta, s0 = _inputs(20, seed=2)
    g[:, :, 12:] = 0
    beta[:, :, 12:] = 0
    _, s_all = chunked_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=8)
    _, s_real = chunked_gated_delta_rule(
        q[:, :, :12], k[:, :, :12], v[:, :, :12], g[:, :, :12], beta[:, :, :12], s0
    )
    assert (s_all - s_real).abs().max() <= 1e-6
    _, moved = chunked_gated_delta_rule(q, k, v, g, torch.rand_like(beta), s0)
    assert (moved - s_real).abs().max() > 1e-3  # the check above can fail


def test_a_differentiated_call_runs_the_pytorch_forms_where_triton_would(monkeypatch):
    """The Triton kernels have no backward: where they run (CUDA, here pretended), a call
    training differentiates takes the PyTorch forms, and an inference call the kernels."""
    calls = []

    def kernel(*args):
        calls.append(len(args))
        raise RuntimeError("the Triton form ran")

    monkeypatch.setattr(ops, "use_triton", lambda device: True)
    monkeypatch.setattr(ops, "delta_rule_chunk_recurrence", kernel)
    monkeypatch.setattr(ops, "recurrent_gated_delta_rule", kernel)
    for rule in (chunked_gated_delta_rule, recurrent_gated_delta_rule):
        q, k, v, g, beta, _ = _inputs(10)
        v.requires_grad_(True)
        out, _ = rule(q, k, v, g, beta)
        out.sum().backward()
        assert v.grad is not None and v.grad.abs().sum() > 0
        with torch.no_grad(), pytest.raises(RuntimeError, match="Triton form ran"):
            rule(q, k, v, g, beta)
    assert len(calls) == 2
