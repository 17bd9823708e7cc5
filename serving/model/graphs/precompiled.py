"""Decode graphs kept on disk whole, so that a restart loads each in well under a second
instead of tracing it again.

Inductor's caches (the FX graph and AOT autograd caches, in `compile_cache_dir`) spare a
restart the code generation and the C++ compiler, but not dynamo's trace of the forward, once
per graph and four graphs a tier: most of a warm start (`loadtests/bench_startup.py`). PyTorch's
AOT precompile (`torch._dynamo.config.enable_aot_compile`, `aot_compile`, then
`save_compiled_function` and `torch.compiler.load_compiled_function`; experimental in 2.13)
serializes a traced graph with its guards and its compiled code, and the module is passed at
each call, so weights are read from the model being served, not from the file.

It is used where a graph has static shapes only: with the paged decode op the block tables
are passed at their full width (the op reads only up to each context length), since a
dynamic dimension marked for `aot_compile` was lost (the loaded graph failed its guards).

A file is named by everything its graph depends on (`graph_key`): torch's version, the
model's config and dtype, the input shapes, the thread count the kernels were generated for,
and the source of the model's and the kernels' code. A file that fails to load is compiled
again and replaced.
"""

import functools
import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import kernels
from serving.model import causal_lm

logger = logging.getLogger(__name__)

_SOURCES = (Path(causal_lm.__file__).parent, Path(kernels.__file__).parent)


@functools.cache
def _source_digest() -> str:
    """The model's and the kernels' code, which a stored graph was traced from: as the process
    read it first, since the code it runs is what it imported, whatever the files say now."""
    digest = hashlib.sha256()
    for root in _SOURCES:
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".cpp", ".h") and path.is_file():
                digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _module_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters, buffers and plain tensor attributes (the KV cache, packed weights)."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    return tensors


def graph_key(model: torch.nn.Module, example: Sequence[object]) -> str:
    """What a stored graph depends on, hashed: a changed part names another file. The
    shapes are the inputs' and the model's tensors' (the KV cache's size is the tier's)."""
    shapes = [
        (tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t)
        for t in [*example, *_module_tensors(model)]
    ]
    parts = [
        torch.__version__,
        repr(model.config),
        str(next(model.parameters()).dtype),
        repr(shapes),
        str(torch.get_num_threads()),
        _source_digest(),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def load(
    model: torch.nn.Module, example: Sequence[object], path: Path
) -> Callable[..., torch.Tensor] | None:
    """The graph stored at `path` if there is one that loads and fits `model` and inputs
    shaped as `example`; call it as `graph(model, *inputs)`, with inputs shaped as `example`:
    its guards are checked once, here, since every call passes the graphs' own buffers, and
    checking them at each call was a visible share of a one-row step."""
    if not path.exists():
        return None
    try:
        with path.open("rb") as f:
            graph = torch.compiler.load_compiled_function(f)
    except Exception:  # a file from an incompatible build
        logger.warning("stored decode graph %s did not load", path)
        return None
    if not graph.guard_check(model, *example):
        logger.warning("stored decode graph %s does not fit this model", path)
        return None
    graph.disable_guard_check()
    return graph


def load_or_compile(
    model: torch.nn.Module, example: Sequence[object], path: Path
) -> Callable[..., torch.Tensor]:
    """The graph of `model`'s forward on inputs shaped as `example`, loaded from `path`, or
    compiled (with the process's inductor config) and stored there, replacing a file that
    did not load. Call it as `graph(model, *inputs)`."""
    graph = load(model, example, path)
    if graph is not None:
        return graph
    with torch._dynamo.config.patch(enable_aot_compile=True):
        compiled = torch.compile(model.forward, fullgraph=True, dynamic=False)
        graph = compiled.aot_compile((tuple(example), {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    graph.save_compiled_function(str(path))  # written whole, then renamed into place
    graph.disable_guard_check()
    return graph
