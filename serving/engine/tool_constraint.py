"""Tool calls as constrained decoding. `tool_choice` "required" or a named function, as vLLM's
structured outputs do it: the output is forced to be exactly one call in the chat template's
form,

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

`tool_choice` "auto" (the default with tools) leaves the output free until the model writes
`<tool_call>`, then holds that call to the same grammar (`OptionalToolCallValidator`): a
small model that answers a tool schema it never saw with a call to a function it knows
(`get_weather` for `get_current_weather`) is held to the names the request offers.
"""

import json
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import torch

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
from serving.engine.tool_arguments import INITIAL_KEYS, argument_keys
from tasks.answers import CALL_END, CALL_START

# Segments, the first field of a state; _TEXT only where calls are optional.
_HEAD, _ARGS, _TAIL, _END, _TEXT = range(5)
_TAIL_BYTES = ("}\n" + CALL_END).encode()
_CALL_START_BYTES = CALL_START.encode()
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
    would end the call there. Their inner state is (JSON state, bytes of it matched so far,
    the function's `ArgumentKeys` or None, their state): where the request gave a function's
    parameter schema, its arguments keep to the declared keys (`tool_arguments`).
    """

    initial_state: tuple[int, Any] = (_HEAD, b"")

    def __init__(
        self,
        names: Iterable[str],
        parameters: Mapping[str, Mapping[str, Any]] | None = None,
        max_whitespace: int = MAX_WHITESPACE,
    ) -> None:
        """`parameters`: the functions' parameter schemas, where given (`tool_arguments`)."""
        self.names = tuple(sorted(set(names)))
        if not self.names:
            raise ValueError("a forced tool call needs at least one function name")
        self.max_whitespace = max_whitespace
        shapes = argument_keys({n: p for n, p in (parameters or {}).items() if n in self.names})
        self._heads = {call_head(name): shapes.get(name) for name in self.names}
        self._head_prefixes = _prefixes(self._heads)
        self._tail_prefixes = _prefixes([_TAIL_BYTES])
        self.state: tuple[int, Any] = self.initial_state

    def step(self, state: tuple[int, Any], c: int) -> tuple[int, Any] | None:
        segment, inner = state
        if segment == _ARGS:
            json_state, matched, shape, keys = inner
            nxt = _step(json_state, c, self.max_whitespace)
            if nxt is None:
                return None
            if shape is not None:
                keys = shape.step_keys(keys, json_state, nxt, c)
                if keys is None:
                    return None
            if nxt[0] == _DONE:
                return _TAIL, b""
            if json_state[0] != _STRING:  # "<" only appears in strings
                return _ARGS, (nxt, 0, shape, keys)
            if c == _CALL_END_BYTES[matched]:
                matched += 1
                if matched == len(_CALL_END_BYTES):
                    return None
                return _ARGS, (nxt, matched, shape, keys)
            return _ARGS, (nxt, 1 if c == 0x3C else 0, shape, keys)
        if segment == _END:
            return None
        text = inner + bytes((c,))
        if segment == _HEAD:
            if text in self._heads:
                shape = self._heads[text]
                return _ARGS, (_INITIAL, 0, shape, None if shape is None else INITIAL_KEYS)
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
        keys = inner[3]
        if keys is not None and (keys[1] is not None or keys[3] is not None):
            return None  # a key, or a value from an enum: only their bytes may follow
        return _CALL_END_BYTES[inner[1] :] if inner[1] else b""  # they would end the call

    @property
    def cache_key(self) -> Hashable:
        # The language: a token may run from a head into the arguments, and past the tail
        # into text where calls are optional.
        return type(self), tuple(self._heads.items()), self.max_whitespace, self.state


class ToolCallConstraint(JsonObjectConstraint):
    """JsonObjectConstraint's rules (only EOS once complete, never special tokens) for one
    forced call to one of `names` instead of a bare JSON object."""

    validator_class: type[ToolCallValidator] = ToolCallValidator

    def __init__(
        self,
        vocab: Vocabulary,
        eos_token_ids: Iterable[int],
        names: Iterable[str],
        parameters: Mapping[str, Mapping[str, Any]] | None = None,
    ):
        super().__init__(vocab, eos_token_ids)
        self.validator = self.validator_class(names, parameters)


class OptionalToolCallValidator(ToolCallValidator):
    """`tool_choice` "auto": free text, in which every `<tool_call>` opens one call in the
    forced call's form (one of `names`, a JSON object of arguments, the tail), after which
    text goes on (another call, or EOS). xgrammar's "structural tag" with `<tool_call>` as
    its trigger: a model may still answer in words, but never calls a function the request
    did not offer or writes arguments the parser cannot read."""

    initial_state = (_TEXT, 0)  # inner: bytes of `<tool_call>` matched so far

    def step(self, state: tuple[int, Any], c: int) -> tuple[int, Any] | None:
        segment, inner = state
        if segment == _TEXT:
            if c != _CALL_START_BYTES[inner]:
                return _TEXT, int(c == _CALL_START_BYTES[0])
            if inner + 1 < len(_CALL_START_BYTES):
                return _TEXT, inner + 1
            return _HEAD, _CALL_START_BYTES
        nxt = super().step(state, c)
        return (_TEXT, 0) if nxt is not None and nxt[0] == _END else nxt

    @property
    def in_text(self) -> bool:
        return self.state[0] == _TEXT

    @property
    def complete(self) -> bool:
        return False  # nothing is owed once a call closes: EOS ends the output as usual


class OptionalToolCallConstraint(ToolCallConstraint):
    """OptionalToolCallValidator's language; outside calls every token may come, EOS and
    special tokens (`<think>`) included, and nothing forces the output to end."""

    validator_class = OptionalToolCallValidator
    validator: OptionalToolCallValidator

    def allows(self, token_id: int) -> bool:
        if token_id >= len(self.vocab):
            return False
        data = self.vocab.token_bytes[token_id]
        return self.validator.in_text if not data else self.validator.accepts(data)

    def advance(self, token_id: int) -> None:
        if not self.allows(token_id):
            raise ValueError(f"token {token_id} cannot continue the constrained output")
        if data := self.vocab.token_bytes[token_id]:
            self.validator.advance(data)

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        mask = super().allowed_mask(vocab_size)
        if self.validator.in_text:  # and the tokens of no bytes: EOS, special tokens
            n = min(vocab_size, len(self.vocab))
            mask[:n] |= self.vocab.byteless[:n]
        return mask
