"""The chat markup the model writes, defined once: `<think>…</think>` reasoning before the
answer and `<tool_call>…</tool_call>` blocks (the tool-call parser is tool_calls.py). The
writers give the exact text the chat template renders (training data, the eval harness
rebuilding a model's raw turn); the reader splits reasoning from the answer, for whole
texts and for streams.

Reasoning opens either in the output (`<think>` as its first non-blank text) or already in the
prompt, in which case the output only closes it with `</think>` (vLLM's Qwen3 and DeepSeek-R1
parsers make the same call). Newlines between the tags and the text are formatting, not
content: the chat template writes them back when it renders the turn again.
"""

from dataclasses import dataclass, field

THINK_START = "<think>"
THINK_END = "</think>"
CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
MARKUP = (THINK_START, THINK_END, CALL_START, CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)


def reasoning_block(reasoning: str) -> str:
    """Reasoning as the template writes it before the answer."""
    return f"{THINK_START}\n{reasoning}\n{THINK_END}\n\n"


def tool_call_block(body: str) -> str:
    """One call's JSON (`{"name": ..., "arguments": {...}}`) as a tool-call block."""
    return f"{CALL_START}\n{body}\n{CALL_END}"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Return (reasoning, content); reasoning is None when the text has none.

    Output cut off inside reasoning (an opening tag, no closing one) is all reasoning.
    """
    stripped = text.lstrip()
    opened = stripped.startswith(THINK_START)
    body = stripped[len(THINK_START) :] if opened else text
    if THINK_END in body:
        reasoning, _, content = body.partition(THINK_END)
        return reasoning.strip("\n") or None, content.lstrip("\n")
    if opened:
        return body.strip("\n") or None, ""
    return None, text


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
