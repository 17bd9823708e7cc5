"""Parse Hermes/Qwen-style tool calls out of a streamed completion, each call whole as its
block closes (`tasks.answers.parse_tool_calls` reads a whole text the same way).
"""

from dataclasses import dataclass, field
from typing import Any

from serving.model.chat_format import partial_suffix
from tasks.answers import CALL_END, CALL_START, ToolCall, parse_call


@dataclass
class ToolCallStream:
    """Incremental `parse_tool_calls`: content deltas stream until a `<tool_call>` opens;
    each call comes out whole, as an OpenAI delta, when its block closes. A malformed block
    comes out as content, since earlier calls may already be sent."""

    calls: list[ToolCall] = field(init=False, default_factory=list)
    _buffer: str = field(init=False, default="")
    _in_call: bool = field(init=False, default=False)
    # Whitespace before the open block: content again if the block turns out malformed.
    _gap: str = field(init=False, default="")
    _after_call: bool = field(init=False, default=False)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self._buffer += delta
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CALL_END)
                if end < 0:
                    return "".join(content), deltas
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_END) :]
                self._close(body, True, content, deltas)
                continue
            if self._after_call:
                self._buffer = self._buffer.lstrip()
                if not self._buffer:
                    return "".join(content), deltas
                self._after_call = False
            start = self._buffer.find(CALL_START)
            if start < 0:
                keep = partial_suffix(self._buffer, CALL_START)
                text = self._buffer[: len(self._buffer) - keep]
                ready = text.rstrip()
                self._buffer = self._buffer[len(ready) :]
                content.append(ready)
                return "".join(content), deltas
            text = self._buffer[:start]
            ready = text.rstrip()
            content.append(ready)
            self._gap = text[len(ready) :]
            self._buffer = self._buffer[start + len(CALL_START) :]
            self._in_call = True

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """Flush the end of the output: held-back text, or a block that was never closed."""
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return ("" if self._after_call else rest), []
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        self._close(rest, False, content, deltas)
        return "".join(content), deltas

    def _close(
        self, body: str, closed: bool, content: list[str], deltas: list[dict[str, Any]]
    ) -> None:
        self._in_call = False
        call = parse_call(body)
        if call is None:
            content.append(self._gap + CALL_START + body + (CALL_END if closed else ""))
        else:
            deltas.append(call.to_openai(len(self.calls)))
            self.calls.append(call)
            self._after_call = True
        self._gap = ""
