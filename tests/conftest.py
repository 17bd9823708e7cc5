"""Shared pytest fixtures."""

import os
import random
from pathlib import Path

import pytest
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

# Without a GPU the Triton kernels run under Triton's interpreter. Triton reads this when a
# kernel module is imported, so it is set here, before any test module imports one (it was
# set by each kernel test module, which broke when another module imported Triton first).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MOST_WORKERS = 4  # every worker loads models and starts servers: memory, not cores, bounds more


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): one worker per core, up to MOST_WORKERS."""
    return min(os.cpu_count() or 1, MOST_WORKERS)


def pytest_configure(config: pytest.Config) -> None:
    """A worker's share of the cores, for its own torch and the processes its tests start:
    two workers each running two intra-op threads on two cores made the torch-bound tests
    2-3x slower (OpenMP threads spin-wait on a core another worker holds)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is not None:
        threads = max(1, (os.cpu_count() or 1) // int(workers))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_tokenizer() -> tokenizers.Tokenizer:
    """A small byte-level BPE tokenizer (like Qwen's), trained in a second on text with
    multibyte characters, so tokens split UTF-8 characters the way real ones do."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "stops"]
    words += ["héllo", "wörld", "日本語", "😀", "naïve", "café", "Ωmega", "ünïcödé", "東京"]
    rng = random.Random(0)
    lines = [" ".join(rng.choices(words, k=rng.randint(3, 12))) + "." for _ in range(400)]
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer)
    return tokenizer


@pytest.fixture(scope="session")
def random_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default ~5M-parameter random Qwen3-MoE with its trained tokenizer and chat
    template (about 5 s to build), in a directory named `tiny-moe`."""
    from training.stages.init_checkpoint import (
        init_checkpoint,  # only the tests that need it load it
    )

    return init_checkpoint(tmp_path_factory.mktemp("checkpoint") / "tiny-moe")


@pytest.fixture
def any_dtype_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every dtype counts as native (`serving/model/dtype.py` refuses a named one the machine
    lacks): paths that name bfloat16 run on any CPU, emulated, with the same numerics."""
    monkeypatch.setattr("serving.model.dtype.is_supported", lambda dtype, device=None: True)


@pytest.fixture
def no_native_float16(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine has no native float16 matmul, as most CPUs (AVX512-FP16 and AMX-FP16 CPUs
    have one): the refusal of a dtype the machine lacks runs everywhere."""
    from serving.model import dtype

    native = dtype.is_supported
    monkeypatch.setattr(
        dtype, "is_supported", lambda t, device=dtype.CPU: t != torch.float16 and native(t, device)
    )
