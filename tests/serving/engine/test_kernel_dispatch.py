"""The serving path's Triton side, run on the CPU: `kernels.ops.use_triton` forced on, under
Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), so the engine's
decode attention, experts and FP4 linears go through the kernels CUDA runs. They must serve
the tokens and logprobs of the PyTorch path. Then the CUDA-graph decode path, with capture
and replay stood in for (replay reruns the captured forward), so its static buffers and
padded rows are checked without a GPU.
"""

import contextlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import kernels.triton_attention
import kernels.triton_gemm
from kernels import ops
from serving.cli import main
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import load_checkpoint
from serving.model.graphs import cuda_graphs
from serving.sampling.params import SamplingParams
from tests.tiny_models import TINY_MOE, prompts, save_tiny_moe

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only checks")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The tiny MoE in fp32, and its NVFP4 copy with every linear in FP4."""
    fp32 = save_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))
    fp4 = tmp_path_factory.mktemp("nvfp4")
    main(["quantize", "--model", str(fp32), "--format", "nvfp4", "--out", str(fp4), "--all-linear"])
    return {"fp32": fp32, "nvfp4": fp4}


def _generate(path: Path, params: list[SamplingParams], **config) -> list:
    engine = LLMEngine(load_checkpoint(path), EngineConfig(**config), eos_token_ids=[])
    outs = engine.generate(prompts(len(params), TINY_MOE["vocab_size"], seed=5), params)
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for [o] in outs]


def _assert_same(got: list, expected: list) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-4)


@pytest.fixture
def triton_calls(monkeypatch) -> dict[str, int]:
    """Forces the Triton side on and counts the kernel calls that reach it."""
    calls = {"attention": 0, "moe": 0, "linear": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(ops, "use_triton", lambda device: True)
    attention = counted("attention", kernels.triton_attention.paged_decode_attention)
    monkeypatch.setattr(kernels.triton_attention, "paged_decode_attention", attention)
    monkeypatch.setattr(ops, "fused_moe", counted("moe", ops.fused_moe))
    linear = counted("linear", kernels.triton_gemm.w4a16_linear)
    monkeypatch.setattr(kernels.triton_gemm, "w4a16_linear", linear)
    return calls


@pytest.mark.parametrize("model", ["fp32", "nvfp4"])
def test_the_triton_kernels_serve_what_the_pytorch_path_serves(checkpoints, triton_calls, model):
    with pytest.MonkeyPatch.context() as patch:  # the reference: CPU dispatch as it is
        patch.setattr(ops, "use_triton", lambda device: False)
        expected = _generate(checkpoints[model], [GREEDY] * 3)
    assert not any(triton_calls.values())
    got = _generate(checkpoints[model], [GREEDY] * 3)
    _assert_same(got, expected)
    assert triton_calls["attention"] and triton_calls["moe"]
    assert bool(triton_calls["linear"]) == (model == "nvfp4")


class _RerunGraph:
    """torch.cuda.CUDAGraph's stand-in: replay reruns the forward captured into it."""

    def __init__(self) -> None:
        self.rerun = None

    def pool(self) -> None:
        return None

    def replay(self) -> None:
        self.rerun()


def test_cuda_graph_decode_steps_serve_what_eager_steps_serve(
    checkpoints, triton_calls, monkeypatch
):
    """Four requests finishing one after another: decode batches of 4, 3 (padded to 4 after a
    step of 4, so its padded row held a real sequence's slot), 2 and 1."""
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
        for n in (9, 7, 5, 3)
    ]
    expected = _generate(checkpoints["nvfp4"], params, max_num_seqs=4)
    forwards, replays = [], []
    original = cuda_graphs.CUDAGraphs._forward

    def forward(self, size):
        forwards.append(lambda: original(self, size))
        original(self, size)

    @contextlib.contextmanager
    def capture(graph, pool=None):
        forwards.clear()
        yield
        graph.rerun = forwards[-1]

    def replay_logged(self, spans):
        replays.append((len(spans), self))
        return replay(self, spans)

    replay = cuda_graphs.CUDAGraphs.run
    monkeypatch.setattr(cuda_graphs, "captured_on", lambda device: True)
    monkeypatch.setattr(cuda_graphs.CUDAGraphs, "_forward", forward)
    monkeypatch.setattr(cuda_graphs.CUDAGraphs, "run", replay_logged)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _RerunGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    got = _generate(checkpoints["nvfp4"], params, max_num_seqs=4, enforce_eager=False)
    _assert_same(got, expected)
    assert sorted({n for n, _ in replays}) == [1, 2, 3, 4]
    graphs = replays[0][1]
    assert graphs.sizes == [1, 2, 4] and set(graphs.graphs) == {1, 2, 4}
    # The last step of three decodes padded its fourth row back to the spare block.
    assert graphs.slots[3] == graphs.spare_slot and graphs.context_lens[3] == 1
    eager = EngineConfig(max_num_seqs=4, enforce_eager=True)
    assert LLMEngine(load_checkpoint(checkpoints["nvfp4"]), eager).runner.paged.graphs is None
