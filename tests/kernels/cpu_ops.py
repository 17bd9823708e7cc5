"""What the tests of the C++ CPU ops share: how they compare results, route tokens, check a
build, and run their own file again at each capability this CPU has."""

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kernels import cpu_dense, cpu_extension

CAPABILITIES = ["DEFAULT", "AVX2", "AVX512"]


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)


def assert_experts_match(got: torch.Tensor, expected: torch.Tensor, rounded: bool) -> None:
    """`rounded`: the op rounded the experts' inner activations to bf16 (bf16 activations as
    bf16 pairs), which `expected` (fp32 throughout) did not: each rounding is 2^-9 of its
    value, so the outputs are within 2^-7 of their largest magnitude, where a wrong product
    would be off by about that magnitude."""
    if not rounded:
        assert_matches(got, expected)
        return
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=2**-7 * float(expected.abs().max()))


def bf16_pairs(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the ops multiply x with these weights as bf16 pairs (an FP4 weight's codes
    are uint8: decoded to bf16 for it)."""
    return (
        x.dtype == torch.bfloat16
        and all(w.dtype in (torch.bfloat16, torch.uint8) for w in weights)
        and cpu_dense.bf16_pairs()
    )


def routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def assert_built(available: Callable[[], bool], ops: str) -> None:
    """The ops build wherever the tests run, and a run at a lowered capability really builds
    for it."""
    assert available(), f"the C++ {ops} ops must build wherever the tests run"
    wanted = os.environ.get("ATEN_CPU_CAPABILITY")
    if wanted:
        assert cpu_extension.capability() == wanted.upper()


def run_at_capability(test_file: Path, capability: str) -> None:
    """The file's other tests in a process whose ATen capability is lowered to `capability`
    (each builds its own library). This process ran them at its own capability, and a
    capability this CPU lacks cannot run here: both skipped."""
    native = cpu_extension.capability()
    below = CAPABILITIES[: CAPABILITIES.index(native)]
    if capability not in below or os.environ.get("ATEN_CPU_CAPABILITY"):
        pytest.skip(f"{capability} is not below this process's {native}")
    env = os.environ | {"ATEN_CPU_CAPABILITY": capability.lower()}
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider"]
    cmd += [str(test_file), "-k", "not every_capability"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=test_file.parents[2])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
