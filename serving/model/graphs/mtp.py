"""The MTP drafter's step compiled at padded batch sizes, as the target's decode steps are.

A draft step is the MTP layer (its decoder block over the MTP layer's own paged KV cache),
its norm and the LM head, for a few rows: the positions the target just computed
(catch-up) or one chained draft per sequence. Run eagerly it is hundreds of small ATen
calls and the Python between them, as costly as a whole compiled target step, and a
speculative step runs it once per draft. So it goes through the same machinery as the
target (`DecodeGraphs`): one graph per padded size, inputs in preallocated buffers, padding
rows writing to the scratch block, graphs stored whole on disk, compiled in the
background and counted in the engine's warm-up. Its one extra input, the target's hidden
state of each row, lives in a buffer of its own that each graph reads up to its size.

The graph returns each row's MTP output and its logits side by side in one tensor
(`DraftRows` splits them), since a graph's output is sliced to the batch and chunks are
joined row-wise. The head reads its weight once for all of a graph's rows
(`kernels/cpu_dense.py`), so the logits of a catch-up's inner positions, which nothing
reads, cost only their products. The argmax and the sampling filters run eagerly on the
rows that draft. While a size is not compiled yet, or a step has more rows than the graphs
take (a prompt's catch-up), the same layer runs eagerly, and the head only on each span's
last row.

Chaining a sequence's greedy drafts inside one graph (each argmax fed to the next depth)
would save a call a draft, but such a graph writes the MTP cache once a depth with the
paged attention op reading it in between, and inductor then copies the whole cache at
every write: many times slower than a call a draft.
"""

from dataclasses import dataclass

import torch
from torch import nn

from serving.model.attention import AttentionMetadata
from serving.model.causal_lm import CausalLM
from serving.model.graphs.decode import DecodeGraphs
from serving.model.linear import linear


class MTPDraftStep(nn.Module):
    """The MTP layer and the LM head over rows of (target hidden state, next token)."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.config = model.config  # the key of stored graphs (`precompiled.graph_key`)
        self.embed_tokens = model.embed_tokens
        self.rotary = model.rotary
        self.layer = model.mtp[0]
        # The head's weight, not its module (which holds a oneDNN copy for eager calls), held
        # as the MTP layer's own weights are (`load_checkpoint`): of a draft step's weight
        # reads, the head's are the most, and a narrower copy of a widened checkpoint's
        # weight is exact.
        self.head_weight = model.lm_head.weight.detach().to(self.layer.eh_proj.weight.dtype)

    def hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """The MTP layer's output at each row: its position's target hidden state combined
        with the embedding of the token after it."""
        rope = self.rotary(positions, hidden.dtype)
        return self.layer(hidden, self.embed_tokens(input_ids), rope, meta, None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """[rows, hidden + vocab]: the MTP output, then its logits (fp32)."""
        out = self.hidden(input_ids, positions, meta, hidden)
        return torch.cat([out, linear(out, self.head_weight).float()], dim=-1)


@dataclass
class DraftRows:
    """A draft step's rows that draft: their MTP outputs (the next chained step's hidden
    input) and their logits."""

    hidden: torch.Tensor  # [n, hidden]
    logits: torch.Tensor  # [n, vocab] fp32

    @classmethod
    def split(cls, joined: torch.Tensor, hidden_size: int) -> "DraftRows":
        return cls(joined[:, :hidden_size], joined[:, hidden_size:])


class MTPGraphs(DecodeGraphs):
    """`MTPDraftStep` compiled at the target's padded batch sizes, over the MTP layer's cache."""

    def __init__(self, step: MTPDraftStep, target: DecodeGraphs) -> None:
        """Compiles after `target`'s graphs, in a thread of its own: one compile at a time, and
        the target's first, since plain decoding needs them and speculation does not."""
        self._target = target
        # Read by the thread; in the dtype the graphs compute in (`DecodeGraphs`).
        dtype = step.embed_tokens.weight.dtype
        self.hidden_rows = torch.zeros(target.sizes[-1], step.config.hidden_size, dtype=dtype)
        super().__init__(
            step,
            target.block_size,
            target.buffers.block_tables.shape[1],
            target.scratch_block,
            target.sizes,
        )

    def _compile(self, model: nn.Module, inputs: list) -> None:
        self._target.wait()
        super()._compile(model, inputs)

    def _arguments(
        self, inputs, tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The decode step's arguments and the target's hidden states of its rows."""
        return (*super()._arguments(inputs, tables), self.hidden_rows[: len(inputs.ids)])

    def draft(
        self,
        hidden: torch.Tensor,
        token_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """`MTPDraftStep`'s output for these rows (the step must `fits_rows`), in chunks of the
        largest size compiled yet: the hidden buffer holds one graph's rows."""
        step = self.ready_sizes[-1]
        parts = []
        for i in range(0, len(token_ids), step):
            rows = slice(i, i + step)
            self.hidden_rows[: len(token_ids[rows])] = hidden[rows]
            parts.append(self.run_rows(token_ids[rows], positions[rows], block_tables[rows]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
