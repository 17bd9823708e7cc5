"""Parse Hermes/Qwen-style tool calls out of a completion, whole or streamed.

The model writes each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
the form the chat template teaches it. Whitespace between the calls and the surrounding
text is the template's formatting, so it is dropped. A final block that was never closed
(generation stopped after the JSON) still counts if its JSON is complete.
"""

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from serving.model.chat_format import CALL_END, CALL_START, partial_suffix

_BLOCK = re.compile(rf"\s*{CALL_START}(.*?)(?:{CALL_END}\s*|\Z)", re.DOTALL)


def _new_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCall:
    """One function call; `arguments` is a JSON string, as the OpenAI API carries it."""

    name: str
    arguments: str
    id: str = field(default_factory=_new_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry; with `index`, the streaming delta form."""
        function = {"name": self.name, "arguments": self.arguments}
        call = {"id": self.id, "type": "function", "function": function}
        return call if index is None else {"index": index, **call}


def _parse_call(body: str) -> ToolCall | None:
    """The call in one block's text, or None if it is not `{"name": str, "arguments": ...}`."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], args) if isinstance(args, str) else None


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Return (content outside the blocks, calls). If any block is malformed, the whole text
    is content and there are no calls: a half-understood call must not be executed."""
    parsed = [_parse_call(m.group(1)) for m in _BLOCK.finditer(text)]
    calls = [call for call in parsed if call is not None]
    if not parsed or len(calls) < len(parsed):
        return text, []
    return _BLOCK.sub("", text), calls


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
        call = _parse_call(body)
        if call is None:
            content.append(self._gap + CALL_START + body + (CALL_END if closed else ""))
        else:
            deltas.append(call.to_openai(len(self.calls)))
            self.calls.append(call)
            self._after_call = True
        self._gap = ""
