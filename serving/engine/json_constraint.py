"""`response_format: {"type": "json_object"}` as constrained decoding, as vLLM's structured
outputs do it: a JSON validator (`serving.engine.json_validator`) decides which tokens may come
next (`serving.engine.token_vocabulary`), the sampler draws only those.
"""

from collections.abc import Iterable

import torch

from serving.engine.json_validator import ByteValidator, JsonValidator
from serving.engine.token_vocabulary import HOST, Vocabulary


class JsonObjectConstraint:
    """Which tokens one sequence may sample next so that its output is a JSON object.

    Before the object closes: the tokens whose bytes the validator accepts (never EOS or
    special tokens). Once it has closed: only EOS, which the engine lets end the sequence
    even with ignore_eos. Whitespace outside strings is capped at MAX_WHITESPACE bytes in a
    row; inside strings and numbers only max_tokens bounds the output, and output cut by
    max_tokens (or a stop string) is a valid prefix, not a whole object.
    """

    def __init__(self, vocab: Vocabulary, eos_token_ids: Iterable[int]) -> None:
        self.vocab = vocab
        self.eos_token_ids = frozenset(eos_token_ids)
        if not self.eos_token_ids:
            raise ValueError("constrained decoding needs an EOS token")
        self.validator: ByteValidator = JsonValidator()

    @property
    def complete(self) -> bool:
        return self.validator.complete

    def allows(self, token_id: int) -> bool:
        if token_id in self.eos_token_ids:
            return self.complete
        data = self.vocab.token_bytes[token_id] if token_id < len(self.vocab) else None
        return data is not None and self.validator.accepts(data)

    def advance(self, token_id: int) -> None:
        """Records the sampled token; raises ValueError if it was not allowed."""
        if not self.allows(token_id):
            raise ValueError(f"token {token_id} cannot continue the constrained output")
        if token_id not in self.eos_token_ids:
            self.validator.advance(self.vocab.token_bytes[token_id])

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        """Bool [vocab_size]: every token `allows`, found in one walk of the vocabulary."""
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=HOST)
        if self.complete:
            mask[[t for t in self.eos_token_ids if t < vocab_size]] = True
            return mask
        allowed = self.vocab.allowed(self.validator)
        n = min(vocab_size, len(allowed))
        mask[:n] = allowed[:n]
        return mask
