"""Reading the chat markup as it streams: `ReasoningStream` splits `<think>` reasoning from
the answer delta by delta, reaching `tasks.answers.split_reasoning`'s result on the whole text
(the markup and the whole-text readers are defined there, once, for the verifiers too).
"""

from dataclasses import dataclass, field

from tasks.answers import THINK_END, THINK_START


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningStream:
    """Incremental `split_reasoning`: feed text deltas, get (reasoning, content) deltas.

    Text that may be part of a tag is held back until it is not, so no partial tag leaks.
    A stream cannot wait to see whether `</think>` comes, so pass `in_reasoning=True` when the
    prompt itself ended inside `<think>`; then the concatenated deltas equal
    `split_reasoning` of the whole text.
    """

    in_reasoning: bool = False
    _mode: str = field(init=False)  # "start" (nothing decided yet), "reasoning" or "content"
    _buffer: str = field(init=False, default="")
    _reasoning_started: bool = field(init=False, default=False)
    _held_newlines: str = field(init=False, default="")
    _strip_content_newlines: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._mode = "reasoning" if self.in_reasoning else "start"

    def feed(self, delta: str) -> tuple[str, str]:
        self._buffer += delta
        reasoning, content = "", ""
        while True:
            if self._mode == "start":
                stripped = self._buffer.lstrip()
                if stripped.startswith(THINK_START):
                    self._buffer = stripped[len(THINK_START) :]
                    self._mode = "reasoning"
                elif THINK_START.startswith(stripped):
                    return reasoning, content  # still could be `<think>`
                else:
                    self._mode = "content"
            elif self._mode == "reasoning":
                end = self._buffer.find(THINK_END)
                if end < 0:
                    keep = partial_suffix(self._buffer, THINK_END)
                    ready = self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(ready) :]
                    return reasoning + self._reasoning(ready, final=False), content
                reasoning += self._reasoning(self._buffer[:end], final=True)
                self._buffer = self._buffer[end + len(THINK_END) :]
                self._mode, self._strip_content_newlines = "content", True
            else:
                return reasoning, content + self._content()

    def finish(self) -> tuple[str, str]:
        """Flush what was held back at the end of the output."""
        rest, self._buffer = self._buffer, ""
        if self._mode == "reasoning":
            return self._reasoning(rest, final=True), ""
        return "", rest  # undecided text is content; content mode holds nothing back

    def _reasoning(self, text: str, final: bool) -> str:
        """Reasoning text without its leading and (once final) trailing newlines."""
        if not self._reasoning_started:
            text = text.lstrip("\n")
            self._reasoning_started = bool(text)
        text = self._held_newlines + text
        body = text.rstrip("\n")
        self._held_newlines = "" if final else text[len(body) :]
        return body

    def _content(self) -> str:
        text, self._buffer = self._buffer, ""
        if self._strip_content_newlines:
            text = text.lstrip("\n")
            self._strip_content_newlines = not text
        return text
