"""Runs one scheduled step: builds the flat token batch, calls the model, samples.

Owns the KV cache tensors (sized from a memory budget) and attaches them to the model's
attention modules. Decodes of every sequence go through one batched attention call;
prefill chunks of different requests, and speculative drafts being verified (the last
token and its k drafts, a chunk of k + 1), share the same forward pass.
"""

from dataclasses import dataclass

import torch

from serving.attention import SHORT_CHUNK, AttentionMetadata, PrefillChunk, ShortChunks
from serving.config import ModelConfig
from serving.model import CausalLM, pack_for_inference
from serving.sampler import Sampler, SamplingRow
from serving.sequence import Sequence, TokenLogprob
from speculative.verify import token_logprobs, verify_drafts


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of one block in every layer, MTP layers included."""
    per_token = 2 * config.num_key_value_heads * config.head_dim * dtype.itemsize
    layers = config.num_hidden_layers + (config.mtp.num_layers if config.mtp else 0)
    return per_token * block_size * layers


@dataclass
class TokenSpan:
    """A sequence's tokens in one forward pass: `token_ids` at positions `start`, `start + 1`..."""

    block_table: list[int]
    start: int
    token_ids: list[int]


@dataclass
class SampledTokens:
    """What a sequence got this step: one token, or accepted drafts and one more."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[TokenLogprob]  # empty unless the request asked for them
    num_draft_tokens: int = 0  # drafts verified this step (0: a plain decode or prefill)


@dataclass
class StepOutput:
    sampled: list[SampledTokens]
    hidden: torch.Tensor  # [tokens, hidden] final hidden states, in `batch` order
    batch: list[tuple[Sequence, int]]  # (sequence, tokens fed), decodes first
    starts: list[int]  # position of each sequence's first token fed


class ModelRunner:
    """Takes the model over for inference: its weights are packed (`pack_for_inference`) and
    frozen, and KV cache tensors are attached to its attention modules (MTP layers too)."""

    def __init__(
        self, model: CausalLM, num_blocks: int, block_size: int, eos_token_ids: list[int]
    ) -> None:
        self.model = model
        self.block_size = block_size
        cfg = model.config
        dtype = model.embed_tokens.weight.dtype
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        pack_for_inference(model)
        blocks = [*model.layers, *(mtp.block for mtp in model.mtp)]
        for layer in blocks:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=dtype)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=dtype)
        self.sampler = Sampler(cfg.vocab_size, eos_token_ids)

    def prepare(
        self, spans: list[TokenSpan]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat input ids, positions and attention metadata; single tokens (decodes) first."""
        bs = self.block_size
        nd = 0
        while nd < len(spans) and len(spans[nd].token_ids) == 1:
            nd += 1
        ids = [s.token_ids[0] for s in spans[:nd]]
        positions = [s.start for s in spans[:nd]]
        decode_slots = [s.block_table[s.start // bs] * bs + s.start % bs for s in spans[:nd]]
        meta = AttentionMetadata(slot_mapping=torch.tensor(decode_slots, dtype=torch.long))
        if nd:
            width = max(len(s.block_table) for s in spans[:nd])
            meta.num_decodes = nd
            meta.decode_block_tables = torch.tensor(
                [s.block_table + [0] * (width - len(s.block_table)) for s in spans[:nd]]
            )
            meta.decode_context_lens = torch.tensor(positions) + 1
        slot_parts = [meta.slot_mapping]
        short: list[tuple[TokenSpan, int]] = []
        for s in spans[nd:]:
            n = len(s.token_ids)
            table = torch.tensor(s.block_table)
            if n <= SHORT_CHUNK:
                short.append((s, len(ids)))
            else:
                meta.prefills.append(PrefillChunk(len(ids), n, s.start + n, table))
            ids.extend(s.token_ids)
            positions.extend(range(s.start, s.start + n))
            pos = torch.arange(s.start, s.start + n)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
        if short:
            meta.short = ShortChunks.build(
                [s.start for s, _ in short],
                [len(s.token_ids) for s, _ in short],
                [offset for _, offset in short],
                [s.block_table for s, _ in short],
                bs,
            )
        meta.slot_mapping = torch.cat(slot_parts)
        meta.prepare(bs)
        return torch.tensor(ids), torch.tensor(positions), meta

    @torch.inference_mode()
    def forward(self, spans: list[TokenSpan]) -> torch.Tensor:
        """Final hidden states of every token of the spans (decodes must come first)."""
        input_ids, positions, meta = self.prepare(spans)
        return self.model(input_ids, positions, meta)

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> StepOutput:
        """One forward over the batch; samples (or verifies drafts) for each sequence that
        reaches its end. A sequence with drafts feeds its last token and the drafts."""
        batch = sorted(batch, key=lambda item: item[1] != 1)  # stable: decodes first
        spans = [_span(seq, n) for seq, n in batch]
        hidden = self.forward(spans)
        rows, last, verify = [], [], []
        offset = 0
        for seq, n in batch:
            if (
                seq.params.prompt_logprobs is not None
                and seq.num_computed_tokens < seq.num_prompt_tokens
            ):
                self._prompt_logprobs(seq, hidden[offset : offset + n], n)
            if seq.num_computed_tokens + n == len(seq) + len(seq.draft_token_ids):
                if seq.draft_token_ids:
                    verify.append((seq, hidden[offset : offset + n]))
                else:
                    rows.append(seq)
                    last.append(offset + n - 1)
            offset += n
        sampled = self._sample(rows, hidden[torch.tensor(last)]) if rows else []
        sampled += [self._verify(seq, h) for seq, h in verify]
        return StepOutput(sampled, hidden, batch, [s.start for s in spans])

    def _sample(self, rows: list[Sequence], hidden: torch.Tensor) -> list[SampledTokens]:
        logits = self.model.compute_logits(hidden)
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
            token, lp, top = result.token_ids[i], result.logprobs[i], result.top_logprobs[i]
            lps = [TokenLogprob(token, lp, top)] if lp is not None else []
            out.append(SampledTokens(seq, [token], lps))
        return out

    def _verify(self, seq: Sequence, hidden: torch.Tensor) -> SampledTokens:
        """The target's logits at the last token and every draft decide what is kept."""
        logits = self.model.compute_logits(hidden)[:, : self.sampler.vocab_size]
        drafts = seq.draft_token_ids
        tokens = verify_drafts(logits, drafts, seq.draft_probs, seq.params, seq.generator)
        lps = []
        if seq.params.logprobs is not None:
            lps = token_logprobs(logits[: len(tokens)], tokens, seq.params.logprobs)
        return SampledTokens(seq, tokens, lps, num_draft_tokens=len(drafts))

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


def _span(seq: Sequence, n: int) -> TokenSpan:
    """The next n tokens a sequence feeds: the rest of its tokens, then its drafts."""
    p = seq.num_computed_tokens
    tokens = seq.token_ids[p : p + n]
    if len(tokens) < n:
        tokens = tokens + seq.draft_token_ids[: n - len(tokens)]
    return TokenSpan(seq.block_table, p, tokens)
