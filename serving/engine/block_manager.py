"""Paged KV cache bookkeeping: fixed-size blocks, reference counts and a prefix cache.

A full block whose keys and values are computed is registered under a hash of its tokens
chained with the hash of the block before it, so two sequences with a common prefix share
the blocks of that prefix. Freed blocks keep their contents and hash until they are
reallocated (least recently freed first), so a later request can still hit them.
"""

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq

from serving.engine.sequence import Sequence


def block_hash(parent: bytes, tokens: Seq[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Per sequence: hashes of its leading full, computed blocks.
        self.seq_hashes: dict[int, list[bytes]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Share of blocks held by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> None:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix.

        The last token is always left to compute: its logits give the next token.
        Requests for prompt logprobs skip the cache: cached tokens have no logits.
        """
        assert not seq.block_table
        hashes: list[bytes] = []
        if self.enable_prefix_caching and seq.params.prompt_logprobs is None:
            parent = b""
            bs = self.block_size
            for i in range((len(seq) - 1) // bs):
                parent = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
                block = self.cached.get(parent)
                if block is None:
                    break
                self._acquire(block)
                seq.block_table.append(block)
                hashes.append(parent)
        self.seq_hashes[seq.seq_id] = hashes
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def _acquire(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more computed tokens; False if the cache is full."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.hash_of[block]
        if old is not None:  # evict its cached contents
            del self.cached[old]
            self.hash_of[block] = None
        self.ref_count[block] = 1
        return block

    def fork(
        self, parent: Sequence, child: Sequence, num_tokens: int
    ) -> list[tuple[int, int]] | None:
        """Give a child with no blocks the parent's first `num_tokens` computed tokens: their
        full blocks shared, the partly filled one copied (the two write different tokens there
        next). Returns the (source, destination) blocks to copy; None if none is free."""
        assert not child.block_table
        full, partial = divmod(num_tokens, self.block_size)
        if partial and not self.free:
            return None
        for block in parent.block_table[:full]:
            self._acquire(block)
            child.block_table.append(block)
        copies = []
        if partial:
            copies.append((parent.block_table[full], self._take_free()))
            child.block_table.append(copies[-1][1])
        child.num_computed_tokens = num_tokens
        return copies

    def register_computed(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        parent = hashes[-1] if hashes else b""
        for i in range(len(hashes), seq.num_computed_tokens // bs):
            parent = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
            block = seq.block_table[i]
            if parent not in self.cached and self.hash_of[block] is None:
                self.cached[parent] = block
                self.hash_of[block] = parent

    def free_unused(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks of the first `num_tokens` positions: rejected speculative
        drafts give back the blocks allocated for them. Those blocks hold no computed
        full block, so none is shared or cached."""
        keep = self.blocks_needed(num_tokens)
        for block in reversed(seq.block_table[keep:]):
            self.ref_count[block] -= 1
            assert self.ref_count[block] == 0 and self.hash_of[block] is None
            self.free[block] = None
            self.free.move_to_end(block, last=False)
        del seq.block_table[keep:]

    def free_sequence(self, seq: Sequence) -> None:
        """Release a sequence's blocks (tail first, so the tail is evicted first)."""
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
                if self.hash_of[block] is None:  # nothing worth keeping: reuse first
                    self.free.move_to_end(block, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.seq_hashes.pop(seq.seq_id, None)
