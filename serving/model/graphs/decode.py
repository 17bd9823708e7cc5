"""Compiled decode steps at padded batch sizes, the way vLLM captures CUDA graphs.

A decode step of a small model on a CPU is bound by per-operation overhead: thousands of
small ATen calls and the Python between them. `torch.compile` (inductor's C++ code) turns
the forward into a few fused kernels, but only for fixed shapes. The projections and the
experts of a step of several rows are C++ ops that read each weight once for all the rows
(`kernels/cpu_dense.py`); a one-row step, or where those cannot be built, writes them as
reductions (`serving/model/linear.py`) and each token's experts read in place
(`gathered_experts`): fused loops that stream row-major weights once per row. Both beat
BLAS's products of a few rows, in fp32 as in bf16.
So, as vLLM does with CUDA graphs, decode steps are padded to the next of a few batch
sizes and each size has its own graph (`dynamic=False`). A step of several tokens per
sequence (drafts to verify, a short prefill chunk) takes one row per token
(`DecodeGraphs.run`); a step of more tokens than the largest size runs eagerly. The paged
model (`serving/model/paged.py`) builds these on a CPU and `CUDAGraphs` on a GPU, and runs
a step in whichever it holds where the step fits (`fits`, `run`), else eagerly.

Inputs live in preallocated buffers: token ids, positions, slots, context lengths, block
tables padded to the longest a sequence can have. Padding rows write their keys and values
to a scratch block that no sequence owns, so they never touch real cache entries. Attention
is the paged decode op (`tierserve_cpu::paged_decode_attention`, `kernels/cpu_attention.py`)
called in the graph, or where that cannot be built, written out in it; either reads the block
tables cut to the longest context, a dynamic dimension of the graph (`graph_decode_attention`).
FP4 experts and linears on a CPU are C++ ops too (`tierserve_fp4::moe`, `tierserve_fp4::linear`,
`kernels/cpu_fp4.py`) that the graphs call, decoding the packed weights inside their products.

Graphs are compiled when the engine starts, in a background thread, smallest size first;
until a size is ready its steps run eagerly, and the engine reports itself warming
(`progress`): the tier server's /health answers 503 with the progress until the graphs full
speed needs are in, as vLLM's server is not healthy before its graphs are captured, so a
gateway routes only to tiers at full speed. Work compiled here after that would not be free:
its tracing and code generation are Python, which takes turns with the engine's thread for
the GIL and slowed a tier's steps several times over while it ran. So a server
(`compile_apart`) compiles here only the one-row graph, which one stream's full speed needs,
and loads the others once an idle-priority process of their own has compiled and stored them
(`serving/engine/compile_process.py`); until then a step of more rows runs in chunks of the
largest size in. Without that process every size compiles here before the engine is ready.
The sizes stop at 8, and a step of more rows (up to `MAX_CHUNKED_ROWS`) runs in chunks of the
largest size, at nearly the cost of a graph of its own, since a chunk of 8 rows already reads
its weights once for all of them.
Compiling in the background rather than before the server listens lets it answer /health
with that progress meanwhile. Inductor's caches live on disk (`compile_cache_dir`), and so do
the graphs whole (`precompiled.py`), so a restart loads them rather than tracing them again
(`loadtests/bench_startup.py` measures a cold start, a warm one and a restart after SIGKILL).
"""

import functools
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kernels import cpu_dense, ops
from serving.model.attention import AttentionMetadata
from serving.model.causal_lm import CausalLM
from serving.model.graphs import precompiled
from serving.model.graphs.inductor_setup import compile_cache_dir, inductor_config
from serving.model.spans import TokenSpan, graph_rows

logger = logging.getLogger(__name__)

# vLLM's smaller capture sizes: each one is seconds of a cold start.
GRAPH_BATCH_SIZES = (1, 2, 4, 8)
# Steps of up to this many rows run in the graphs, in chunks of the largest size.
MAX_CHUNKED_ROWS = 32


def graph_sizes(max_num_seqs: int, verify_rows: int = 0) -> list[int]:
    """The capture sizes a batch of up to `max_num_seqs` sequences pads to, and where an
    engine speculates, `verify_rows` (k + 1: one sequence's last token and its drafts) as a
    size of its own, as vLLM captures sizes suited to the speculative shape: a sequence's
    verify step then runs unpadded instead of in the next larger graph, whose padding rows
    cost as much as real ones."""
    sizes = [s for s in GRAPH_BATCH_SIZES if s < max_num_seqs]
    sizes += [s for s in GRAPH_BATCH_SIZES if s >= max_num_seqs][:1]
    if 1 < verify_rows <= MAX_CHUNKED_ROWS:
        sizes = sorted({*sizes, verify_rows})
    return sizes


class Progress(NamedTuple):
    """How far the warm-up is: graphs compiled of those wanted; `ready` once the graphs that
    full speed needs are in (the one-row graph, where the others compile apart); `done` once
    the compile thread has ended (every graph compiled, or a failure that leaves the rest
    eager)."""

    compiled: int
    wanted: int
    ready: bool
    done: bool


@dataclass
class _Inputs:
    """A decode step's inputs for `size` sequences; rows past the batch are padding."""

    ids: torch.Tensor  # [size]
    positions: torch.Tensor  # [size]
    slots: torch.Tensor  # [size]
    context_lens: torch.Tensor  # [size]
    block_tables: torch.Tensor  # [size, max_blocks]

    @classmethod
    def padding(cls, size: int, max_blocks: int, block_size: int, scratch_block: int) -> "_Inputs":
        """Every row a padding row: token 0 at position 0, in the scratch block."""
        return cls(
            ids=torch.zeros(size, dtype=torch.long),
            positions=torch.zeros(size, dtype=torch.long),
            slots=torch.full((size,), scratch_block * block_size, dtype=torch.long),
            context_lens=torch.ones(size, dtype=torch.long),
            block_tables=torch.full((size, max_blocks), scratch_block, dtype=torch.long),
        )

    def head(self, size: int) -> "_Inputs":
        return _Inputs(*(t[:size] for t in vars(self).values()))

    def host(self) -> "_Inputs":
        """The same memory as numpy arrays: a step writes its host ints through them, each
        write a fraction of the cost of an indexed copy into a tensor."""
        return _Inputs(*(t.numpy() for t in vars(self).values()))


class DecodeGraphs:
    """One compiled decode forward per padded batch size over one model's KV cache."""

    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        max_blocks: int,
        scratch_block: int,
        sizes: list[int],
        compile_apart: Callable[[], subprocess.Popen] | None = None,
    ) -> None:
        """`max_blocks`: the most blocks a sequence can hold; `scratch_block`: a cache block
        no sequence owns, where padding rows write. `compile_apart` starts a process that
        compiles and stores this model's graphs (`serving/engine/compile_process.py`): with
        it, graphs past the first that are not stored yet are compiled there, not here.
        Starts compiling in the background."""
        # Set, not defaulted: importing some libraries (torchao) sets it to inductor's /tmp default.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir())
        self.sizes = sizes
        self.block_size = block_size
        self.scratch_block = scratch_block
        # Attention as the paged decode op inside the graph where it is built, else written out.
        self.paged_kernel = ops.has_paged_decode_attention(torch.device("cpu"))
        # The dense projections' and experts' op, built (or loaded) before any graph calls it:
        # a stored graph calls it without tracing the code that loads it.
        self.dense_kernel = cpu_dense.available()
        padding = functools.partial(
            _Inputs.padding,
            max_blocks=max_blocks,
            block_size=block_size,
            scratch_block=scratch_block,
        )
        self.buffers = padding(sizes[-1])
        self._host = self.buffers.host()
        # Each size's leading rows of the buffers and, for its stored graph, the forward's
        # arguments over them: the same views every step, built once.
        self._heads = {size: self.buffers.head(size) for size in sizes}
        self._stored_arguments = {
            size: self._arguments(head, head.block_tables) for size, head in self._heads.items()
        }
        self.model = model
        self.forward: Callable[..., torch.Tensor] | None = None  # set by the thread
        self._stored: dict[int, Callable[..., torch.Tensor]] = {}  # by size (`precompiled`)
        self.ready_sizes: tuple[int, ...] = ()  # compiled, ascending; replaced whole
        self.ready = False  # the graphs compiled here are in
        self.done = False  # the compile thread has ended
        self._compile_apart = compile_apart
        # Made here, not in the thread's inference mode: guards tell inference tensors apart.
        inputs = [padding(size) for size in sizes]
        self._capture = threading.Thread(
            target=self._compile, args=(model, inputs), name="decode-graphs", daemon=True
        )
        self._capture.start()
        self._apart: threading.Thread | None = None  # waits for the compile process

    def wait(self) -> None:
        """Until every size is compiled (benchmarks and tests)."""
        self._capture.join()
        if self._apart is not None:
            self._apart.join()

    def progress(self) -> Progress:
        return Progress(len(self.ready_sizes), len(self.sizes), self.ready, self.done)

    @torch.inference_mode()
    def _compile(self, model: CausalLM, inputs: list[_Inputs]) -> None:
        """Each size on inputs of its own (padding rows: they touch only the scratch block),
        so the engine may use the buffers meanwhile. A failure leaves the rest eager. Even
        `torch.compile` is called here: its first call imports dynamo, which would otherwise
        hold the server's start."""
        start = time.monotonic()
        # Whole graphs on disk (`precompiled`): static shapes only, and only graphs of the C++
        # ops, which their key does not tell apart from the fallbacks.
        store = self.paged_kernel and self.dense_kernel
        apart: list[tuple[_Inputs, Path]] = []  # left to the process of `compile_apart`
        try:
            self.forward = torch.compile(model, dynamic=False, fullgraph=True)
            # One cache entry per size and model (a process may hold several engines);
            # dynamo's config is per thread.
            torch._dynamo.config.recompile_limit = 64
            with inductor_config():
                for i, padding in enumerate(inputs):
                    if store:
                        example, path = self._stored_at(padding)
                        if i and self._compile_apart is not None and not path.exists():
                            apart.append((padding, path))
                            continue
                        self._stored[len(padding.ids)] = precompiled.load_or_compile(
                            model, example, path
                        )
                    self._add_ready(padding)
            self.ready = True
            logger.info(
                "compiled decode steps for batch sizes %s in %.1f s (cache: %s%s)",
                list(self.ready_sizes),
                time.monotonic() - start,
                os.environ["TORCHINDUCTOR_CACHE_DIR"],
                ", whole graphs in graphs/" if store else "",
            )
            if apart:
                # Waited for from a thread of its own: while this thread, which ran the graphs,
                # sat blocked waiting, one-row steps ran several times slower (measured; torch's
                # threads are per calling thread), and ran at full speed once it had ended.
                self._apart = threading.Thread(
                    target=self._load_compiled_apart, args=(apart,), name="decode-graphs-apart",
                    daemon=True,
                )  # fmt: skip
                self._apart.start()
        except Exception:
            logger.exception("compiling decode steps failed; they run eagerly")
        finally:
            self.ready = True
            self.done = self._apart is None

    @torch.inference_mode()  # as the graphs were compiled, and as their guards check
    def _load_compiled_apart(self, inputs: list[tuple[_Inputs, Path]]) -> None:
        """Start the process that compiles the sizes of `inputs`, wait for it, and load the
        graphs it stored at their paths. A size it did not store stays uncompiled: its steps
        run in chunks of the largest size compiled."""
        assert self._compile_apart is not None
        try:
            self._load_apart(inputs)
        except Exception:
            logger.exception("loading the decode steps compiled apart failed; steps run in chunks")
        finally:
            self.done = True

    def _load_apart(self, inputs: list[tuple[_Inputs, Path]]) -> None:
        assert self._compile_apart is not None
        start = time.monotonic()
        sizes = [len(padding.ids) for padding, _ in inputs]
        process = self._compile_apart()
        logger.info(
            "compiling decode steps for batch sizes %s apart, in process %d", sizes, process.pid
        )
        returncode = process.wait()
        for padding, path in inputs:
            example = self._arguments(padding, padding.block_tables)
            graph = precompiled.load(self.model, example, path)
            if graph is None:
                logger.warning(
                    "no decode graph of %d rows was stored (compile process exit status %d); "
                    "those steps run in chunks",
                    len(padding.ids),
                    returncode,
                )
                continue
            self._stored[len(padding.ids)] = graph
            self._add_ready(padding)
        logger.info(
            "loaded decode steps for batch sizes %s, compiled apart in %.1f s",
            sizes,
            time.monotonic() - start,
        )

    def _stored_at(self, padding: _Inputs) -> tuple[tuple[object, ...], Path]:
        """A size's example arguments and the file its whole graph is stored in."""
        example = self._arguments(padding, padding.block_tables)
        return example, compile_cache_dir().parent / "graphs" / precompiled.graph_key(
            self.model, example
        )

    def _add_ready(self, padding: _Inputs) -> None:
        """Run the size's graph once (its first call does one-time work), then offer it."""
        self._call(padding)
        self.ready_sizes = tuple(sorted((*self.ready_sizes, len(padding.ids))))

    def fits(self, spans: list[TokenSpan]) -> bool:
        """Whether a step over these spans can run in compiled graphs now (`fits_rows`)."""
        return self.fits_rows(
            sum(len(s.token_ids) for s in spans), max(len(s.block_table) for s in spans)
        )

    def run(self, spans: list[TokenSpan]) -> torch.Tensor:
        """Final hidden states of every token of the spans (decodes first), one row a token:
        every row's key and value are written before any row attends, and each row attends
        up to its own position, so the tokens of one span see each other causally, as in a
        prefill."""
        return self.run_rows(*graph_rows(spans))

    def fits_rows(self, num_rows: int, max_table_len: int) -> bool:
        """Whether a decode step of `num_rows` rows can run in compiled graphs now: in one,
        or in chunks of the largest compiled one (beyond the largest size, or while the
        larger sizes still compile)."""
        return (
            bool(self.ready_sizes)
            and num_rows <= max(MAX_CHUNKED_ROWS, self.sizes[-1])
            and max_table_len <= self.buffers.block_tables.shape[1]
        )

    def run_rows(
        self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:
        """Final hidden states [B, hidden] of one row a token, in the smallest compiled
        graph of B rows or more (the step must fit: `fits_rows`). Past the largest size
        compiled yet, the rows run in chunks of it, in order: a decode row depends on no
        other row of its step, and a span's rows see the keys and values its earlier chunks
        wrote, as in one graph."""
        b = len(token_ids)
        ready = self.ready_sizes
        size = next((s for s in ready if s >= b), None)
        if size is None:
            parts = [slice(i, i + ready[-1]) for i in range(0, b, ready[-1])]
            return torch.cat(
                [self.run_rows(token_ids[p], positions[p], block_tables[p]) for p in parts]
            )
        bs = self.block_size
        host = self._host
        host.ids[:b] = token_ids
        host.positions[:b] = positions
        np.add(host.positions[:b], 1, out=host.context_lens[:b])
        width = max(map(len, block_tables))
        for i, (table, p) in enumerate(zip(block_tables, positions, strict=True)):
            host.slots[i] = table[p // bs] * bs + p % bs
            host.block_tables[i, : len(table)] = table
            host.block_tables[i, len(table) : width] = 0
        host.ids[b:size] = 0
        host.positions[b:size] = 0
        host.slots[b:size] = self.scratch_block * bs
        host.context_lens[b:size] = 1
        host.block_tables[b:size, 0] = self.scratch_block
        return self._call(self._heads[size])[:b]

    def _call(self, inputs: _Inputs) -> torch.Tensor:
        """The compiled forward: a stored graph over the block tables' full width, or the
        traced one over block tables cut to the longest context (at least 2 blocks: dynamo
        specializes a dimension of size 1, which would compile a second graph)."""
        size = len(inputs.ids)
        stored = self._stored.get(size)
        if stored is not None:
            if inputs is self._heads.get(size):
                return stored(self.model, *self._stored_arguments[size])
            return stored(self.model, *self._arguments(inputs, inputs.block_tables))
        blocks = max(2, -(-int(inputs.context_lens.max()) // self.block_size))
        tables = inputs.block_tables[:, :blocks]
        torch._dynamo.mark_dynamic(tables, 1)
        return self.forward(*self._arguments(inputs, tables))

    def _arguments(
        self, inputs: _Inputs, tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The model's forward arguments for a decode step over these block tables."""
        meta = AttentionMetadata(
            slot_mapping=inputs.slots,
            num_decodes=inputs.ids.shape[0],
            decode_block_tables=tables,
            decode_context_lens=inputs.context_lens,
            in_graph=True,
            paged_kernel=self.paged_kernel,
        )
        return inputs.ids, inputs.positions, meta
