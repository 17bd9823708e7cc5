"""Runs one scheduled step: builds the flat token batch, calls the model, samples.

Owns the KV cache tensors (sized from a memory budget) and attaches them to the model's
attention modules. Decodes of every sequence go through one batched attention call;
prefill chunks of different requests share the same forward pass.
"""

from dataclasses import dataclass

import torch

from serving.attention import AttentionMetadata, PrefillChunk
from serving.config import ModelConfig
from serving.model import CausalLM, pack_for_inference
from serving.sampler import Sampler, SamplingRow
from serving.sequence import Sequence, TokenLogprob


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * config.num_key_value_heads * config.head_dim * dtype.itemsize
    return per_token * block_size * config.num_hidden_layers


@dataclass
class SampledToken:
    seq: Sequence
    token_id: int
    logprob: TokenLogprob | None


class ModelRunner:
    """Takes the model over for inference: its weights are packed (`pack_for_inference`) and
    frozen, and KV cache tensors are attached to its attention modules."""

    def __init__(
        self, model: CausalLM, num_blocks: int, block_size: int, eos_token_ids: list[int]
    ) -> None:
        self.model = model
        self.block_size = block_size
        cfg = model.config
        dtype = model.embed_tokens.weight.dtype
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        pack_for_inference(model)
        for layer in model.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=dtype)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=dtype)
        self.sampler = Sampler(cfg.vocab_size, eos_token_ids)

    def _slots(self, seq: Sequence, start: int, n: int) -> torch.Tensor:
        pos = torch.arange(start, start + n)
        table = torch.tensor(seq.block_table)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(
        self, batch: list[tuple[Sequence, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat input ids, positions and attention metadata; decodes (n == 1) come first."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        decode_slots: list[int] = []
        tables: list[list[int]] = []
        for seq, _ in batch[: self._num_decodes(batch)]:
            p = seq.num_computed_tokens
            ids.append(seq.token_ids[p])
            positions.append(p)
            decode_slots.append(seq.block_table[p // bs] * bs + p % bs)
            tables.append(seq.block_table)
        meta = AttentionMetadata(slot_mapping=torch.tensor(decode_slots, dtype=torch.long))
        if tables:
            width = max(len(t) for t in tables)
            meta.num_decodes = len(tables)
            meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
            meta.decode_context_lens = torch.tensor(positions) + 1
        slot_parts = [meta.slot_mapping]
        for seq, n in batch[meta.num_decodes :]:
            p = seq.num_computed_tokens
            meta.prefills.append(PrefillChunk(len(ids), n, p + n, torch.tensor(seq.block_table)))
            ids.extend(seq.token_ids[p : p + n])
            positions.extend(range(p, p + n))
            slot_parts.append(self._slots(seq, p, n))
        meta.slot_mapping = torch.cat(slot_parts)
        meta.prepare(bs)
        return torch.tensor(ids), torch.tensor(positions), meta

    @staticmethod
    def _num_decodes(batch: list[tuple[Sequence, int]]) -> int:
        n = 0
        while n < len(batch) and batch[n][1] == 1:
            n += 1
        return n

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> list[SampledToken]:
        """One forward over the batch; samples for each sequence that reaches its end."""
        batch = sorted(batch, key=lambda item: item[1] != 1)  # stable: decodes first
        input_ids, positions, meta = self.prepare(batch)
        hidden = self.model(input_ids, positions, meta)
        rows, last = [], []
        offset = 0
        for seq, n in batch:
            if (
                seq.params.prompt_logprobs is not None
                and seq.num_computed_tokens < seq.num_prompt_tokens
            ):
                self._prompt_logprobs(seq, hidden[offset : offset + n], n)
            if seq.num_computed_tokens + n == len(seq):
                rows.append(seq)
                last.append(offset + n - 1)
            offset += n
        if not rows:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(last)])
        result = self.sampler(
            logits,
            [
                SamplingRow(
                    s.params, s.prompt_token_ids, s.output_token_ids, s.generator, s.constraint
                )
                for s in rows
            ],
        )
        out = []
        for i, seq in enumerate(rows):
            lp = None
            if result.logprobs[i] is not None:
                lp = TokenLogprob(result.token_ids[i], result.logprobs[i], result.top_logprobs[i])
            out.append(SampledToken(seq, result.token_ids[i], lp))
        return out

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, n: int) -> None:
        """Logprob of each prompt token given the ones before it (first token: None).

        Position p predicts token p + 1; tokens already scored (before a preemption) are skipped.
        """
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)
        start = seq.num_computed_tokens
        lo = max(start + 1, len(seq.prompt_logprobs))
        hi = min(start + n + 1, seq.num_prompt_tokens)
        if hi <= lo:
            return
        logprobs = self.model.compute_logits(hidden[lo - 1 - start : hi - 1 - start]).log_softmax(
            -1
        )
        targets = torch.tensor(seq.token_ids[lo:hi])
        chosen = logprobs.gather(-1, targets[:, None]).squeeze(-1).tolist()
        k = seq.params.prompt_logprobs
        top = logprobs.topk(k, dim=-1) if k else None
        for i, (tok, lp) in enumerate(zip(targets.tolist(), chosen, strict=True)):
            pairs = None
            if top is not None:
                pairs = list(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True))
            seq.prompt_logprobs.append(TokenLogprob(tok, lp, pairs))
