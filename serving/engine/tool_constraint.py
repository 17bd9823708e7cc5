"""`tool_choice` "required" or a named function as constrained decoding, as vLLM's structured
outputs do it: the output is forced to be exactly one call in the chat template's form,

    <tool_call>
    {"name": "<one of the names>", "arguments": <a JSON object>}
    </tool_call>

then EOS, which `tool_parser` reads back as one OpenAI tool call.

The grammar is three segments in a row: a choice of literal heads (`<tool_call>\\n{"name":
"get_weather", "arguments": ` for each allowed name), a JSON object (json_constraint's
automaton, whitespace bounded as for json_object), and the literal tail. A state is
(segment, inner state), so it is immutable and hashable like a JSON state, and json
constraint's token tries and mask cache serve it unchanged: a token may straddle segments
(`{"`, `}}\\n`), and the added token `<tool_call>` is matched by its bytes like any other.
"""

import json
from collections.abc import Hashable, Iterable
from typing import Any

from serving.engine.json_constraint import JsonObjectConstraint
from serving.engine.json_validator import (
    _DONE,
    _INITIAL,
    _STRING,
    MAX_WHITESPACE,
    ByteValidator,
    _step,
)
from serving.engine.token_vocabulary import Vocabulary
from serving.model.chat_format import CALL_END, CALL_START

# Segments, the first field of a state.
_HEAD, _ARGS, _TAIL, _END = range(4)
_TAIL_BYTES = ("}\n" + CALL_END).encode()
_CALL_END_BYTES = CALL_END.encode()


def call_head(name: str) -> bytes:
    """The bytes before the arguments of a call to `name`, as the chat template writes them."""
    return f'{CALL_START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '.encode()


def _prefixes(literals: Iterable[bytes]) -> frozenset[bytes]:
    return frozenset(lit[:i] for lit in literals for i in range(len(lit)))


class ToolCallValidator(ByteValidator):
    """Accepts exactly the prefixes of one forced call to one of `names`.

    Heads are prefix-free (a JSON string ends at its only unescaped quote), so a head is
    complete as soon as its bytes match, and the arguments start there. The arguments'
    strings may not spell `</tool_call>` (a model can write `<\\/tool_call>`): the parser
    would end the call there. Their inner state is (JSON state, bytes of it matched so far).
    """

    def __init__(self, names: Iterable[str], max_whitespace: int = MAX_WHITESPACE) -> None:
        self.names = tuple(sorted(set(names)))
        if not self.names:
            raise ValueError("a forced tool call needs at least one function name")
        self.max_whitespace = max_whitespace
        self._heads = frozenset(call_head(name) for name in self.names)
        self._head_prefixes = _prefixes(self._heads)
        self._tail_prefixes = _prefixes([_TAIL_BYTES])
        self.state: tuple[int, Any] = (_HEAD, b"")

    def step(self, state: tuple[int, Any], c: int) -> tuple[int, Any] | None:
        segment, inner = state
        if segment == _ARGS:
            json_state, matched = inner
            nxt = _step(json_state, c, self.max_whitespace)
            if nxt is None:
                return None
            if nxt[0] == _DONE:
                return _TAIL, b""
            if json_state[0] != _STRING:  # "<" only appears in strings
                return _ARGS, (nxt, 0)
            if c == _CALL_END_BYTES[matched]:
                matched += 1
                return None if matched == len(_CALL_END_BYTES) else (_ARGS, (nxt, matched))
            return _ARGS, (nxt, 1 if c == 0x3C else 0)
        if segment == _END:
            return None
        text = inner + bytes((c,))
        if segment == _HEAD:
            if text in self._heads:
                return _ARGS, (_INITIAL, 0)
            return (_HEAD, text) if text in self._head_prefixes else None
        if text == _TAIL_BYTES:
            return _END, None
        return (_TAIL, text) if text in self._tail_prefixes else None

    @property
    def complete(self) -> bool:
        return self.state[0] == _END

    @property
    def plain_rejected(self) -> bytes | None:
        segment, inner = self.state
        if segment != _ARGS or inner[0][0] != _STRING:
            return None
        return _CALL_END_BYTES[inner[1] :] if inner[1] else b""  # they would end the call

    @property
    def cache_key(self) -> Hashable:
        return self.names, self.max_whitespace, self.state


class ToolCallConstraint(JsonObjectConstraint):
    """JsonObjectConstraint's rules (only EOS once complete, never special tokens) for one
    forced call to one of `names` instead of a bare JSON object."""

    def __init__(self, vocab: Vocabulary, eos_token_ids: Iterable[int], names: Iterable[str]):
        super().__init__(vocab, eos_token_ids)
        self.validator = ToolCallValidator(names)
