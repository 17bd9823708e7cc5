"""Tool-chain codes redrawn from the tokenizer's own multi-character pieces, for training.

A chain's answer copies a code from the last tool result (`"confirmation": "J394XR"`). BPE
cuts a random code mostly into single characters, with a merged piece here and there (`XR`,
`PZ`, `pf`). A small model learns to copy the single characters and drops or swaps the merged
pieces (`GPZS7R` as `GPS7R`): each piece turns up in a handful of training codes at most, too
rarely to learn to copy it. So a share of the training chains get a code of the same form
built largely from those pieces; the held-out tasks keep the generators' codes. On its own
this did not teach the copy; drills that train it in a short context
(`training.data.copy_drills`) did, and the two are used together.
"""

import dataclasses
import json
import random
from dataclasses import dataclass

from serving.model.tokenizer import Tokenizer
from tasks.base import Task
from tasks.tool_tasks import CODE_CHARS

PREFIXES = ("TRK", "BK-", "msg_")  # what `tool_tasks` puts before a chain's random code
PIECE_SHARE = 0.6  # chance that the next part of a redrawn code is a merged piece


@dataclass(frozen=True)
class CodePieces:
    share: float  # of the chains whose code is redrawn
    upper: tuple[str, ...]  # the tokenizer's pieces of 2-3 characters of CODE_CHARS
    lower: tuple[str, ...]  # and of their lower case (message ids)

    @classmethod
    def of(cls, tokenizer: Tokenizer, share: float) -> "CodePieces":
        pieces = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]

        def made_of(chars: str) -> tuple[str, ...]:
            return tuple(sorted(p for p in pieces if 2 <= len(p) <= 3 and set(p) <= set(chars)))

        return cls(share, made_of(CODE_CHARS), made_of(CODE_CHARS.lower()))

    def like(self, key: str, rng: random.Random) -> str:
        """A code of the same prefix, length and case as `key`, largely of merged pieces."""
        prefix = next((p for p in PREFIXES if key.startswith(p)), "")
        body = key[len(prefix) :]
        lower = body == body.lower()
        chars, pieces = (CODE_CHARS.lower(), self.lower) if lower else (CODE_CHARS, self.upper)
        code = ""
        while len(code) < len(body):
            fits = [p for p in pieces if len(code) + len(p) <= len(body)]
            code += rng.choice(fits) if fits and rng.random() < PIECE_SHARE else rng.choice(chars)
        return prefix + code

    def redraw(self, task: Task, rng: random.Random) -> Task:
        """The task with its code (`data["key"]`) replaced everywhere by one of the same
        prefix, length and case, or the task itself (not a chain, or not drawn)."""
        key = task.data.get("key") if task.domain == "tools" else None
        if not key or rng.random() >= self.share:
            return task
        old, new = (json.dumps(k, ensure_ascii=False)[1:-1] for k in (key, self.like(key, rng)))
        data = json.loads(json.dumps(task.data, ensure_ascii=False).replace(old, new))
        return dataclasses.replace(task, data=data)
