"""Incremental detokenization with stop strings: token ids in, final text deltas out."""

import tokenizers

from serving.sampling.params import SamplingParams

# Prompt tokens decoded ahead of the output, so the first output token decodes in context
# (leading spaces, merges across the boundary), as vLLM does.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, holding back what may still change.

    Two things may change. A byte-level token can end inside a UTF-8 character, which
    decodes as U+FFFD until a later token completes it: decoding uses the prefix/read
    offsets of vLLM and TGI, decoding only the tokens since the last emitted text plus the
    ones before them as context, and emits the new suffix once it does not end in U+FFFD.
    So a call costs O(new tokens), and the deltas concatenate to the decode of the output.
    And a tail that may be the start of a stop string: while streaming, the longest suffix
    that is a proper prefix of some stop string is held back, so no client ever sees text
    that a stop string later cuts.

    Stop strings follow vLLM: they are looked for once at least `min_tokens` tokens are
    out, only in matches that end in new text; the first match to end wins (the longer one
    on a tie); the output ends before it, or after it with include_stop_str_in_output (then
    nothing needs holding back). After a match nothing more is emitted.
    """

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = [s for s in params.stop if s]
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._lookback = max(map(len, self._stops), default=1) - 1
        # Token window: ids[:read] is context (already emitted), ids[read:] is pending.
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._read = len(self._ids)
        self._num_output = 0
        self._recent = ""  # last `lookback` chars of the decoded text, where stops may start
        self._held = 0  # how many of those are held back (not emitted yet)
        self._parts: list[str] = []
        self._stop_reason: str | None = None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, once one has."""
        return self._stop_reason

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._parts)

    def add(self, token_ids: list[int]) -> str:
        """Appends tokens; returns the newly final text delta ("" if nothing yet)."""
        if self._stop_reason is not None:
            return ""
        self._ids += token_ids
        self._num_output += len(token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """On finish (length, EOS, abort): releases held-back text, never past a stop."""
        if self._stop_reason is not None:
            return ""
        return self._emit(self._decode_new(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        """Text of the pending tokens once complete, moving the window past them."""
        prefix_text = self._decode(self._ids[: self._read])
        new_text = self._decode(self._ids)
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        self._ids = self._ids[self._read :]  # the pending tokens become the next context
        self._read = len(self._ids)
        return new_text[len(prefix_text) :]

    def _emit(self, new: str, final: bool) -> str:
        """Checks `new` for stop strings; records and returns what is now final."""
        window = self._recent + new
        start = len(self._recent) - self._held  # window[start:] is not emitted yet
        match = None
        if self._num_output >= self._min_tokens:
            match = self._find_stop(window, len(self._recent))
        if match is not None:
            self._stop_reason, end = match
        else:
            end = len(window) - (0 if final else self._holdback(window[start:]))
            self._held = len(window) - end
            self._recent = window[max(0, len(window) - self._lookback) :]
        delta = window[start:end]
        if delta:
            self._parts.append(delta)
        return delta

    def _find_stop(self, window: str, old: int) -> tuple[str, int] | None:
        """The first stop string to end past window[:old], and where the output ends."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            i = window.find(stop, max(0, old - len(stop) + 1))
            if i != -1 and (best is None or (i + len(stop), i) < best[:2]):
                best = (i + len(stop), i, stop)
        if best is None:
            return None
        end, begin, stop = best
        return stop, end if self._include_stop else begin

    def _holdback(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that may start a stop string."""
        if self._include_stop:
            return 0
        for n in range(min(len(pending), self._lookback), 0, -1):
            tail = pending[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0
