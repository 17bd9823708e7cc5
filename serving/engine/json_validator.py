"""The JSON grammar as a byte-level validator, for constrained decoding
(`serving.engine.json_constraint`).

The validator runs on bytes, not text: a byte-level BPE token may end inside a UTF-8
character, so only bytes compose exactly token by token. Inside strings it checks UTF-8
itself (RFC 3629: no overlongs, no surrogates), so the output's bytes always decode, and the
detokenized text is exactly the JSON the validator accepted.

States are immutable tuples and `_step` is a pure function, so testing a candidate token
copies nothing and a state is its own cache key.
"""

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any

# Whitespace allowed in a row outside strings. A model that has nothing left to say inside
# an open object can emit spaces forever (every one is valid JSON); the bound forces it on.
# 32 leaves room for a newline plus 4-space indentation 7 levels deep.
MAX_WHITESPACE = 32

# Modes, the first field of a state.
(
    _START,  # before the top-level object: whitespace or "{"
    _VALUE,  # after ":" or an array's ",": a value
    _ARRAY_FIRST,  # after "[": a value or "]"
    _OBJECT_FIRST,  # after "{": a key or "}"
    _KEY,  # after an object's ",": a key
    _COLON,  # after a key
    _AFTER,  # after a value: "," or the closing bracket
    _STRING,
    _ESCAPE,  # after a backslash
    _HEX,  # in \uXXXX; aux = hex digits left
    _UTF8,  # inside a multibyte character; aux = (bytes left, lowest, highest next byte)
    _MINUS,  # numbers, per the JSON grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
    _ZERO,
    _INT,
    _DOT,
    _FRAC,
    _EXP_MARK,
    _EXP_SIGN,
    _EXP,
    _LITERAL,  # in true/false/null; aux = the bytes still expected
    _DONE,  # the top-level object has closed
) = range(21)

# A state: (mode, stack, whitespace run, in a key string, aux). The stack is a str of "{"
# and "[", innermost last.
State = tuple[int, str, int, bool, Any]
_INITIAL: State = (_START, "", 0, False, 0)

_WHITESPACE = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrtu')
_NUMBER_END = {_ZERO, _INT, _FRAC, _EXP}  # where a number may end
_DIGIT_NEXT = {_INT: _INT, _DOT: _FRAC, _FRAC: _FRAC, _EXP_MARK: _EXP, _EXP_SIGN: _EXP, _EXP: _EXP}
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
_CLOSE = {"{": ord("}"), "[": ord("]")}


def _utf8_lead(c: int) -> tuple[int, int, int] | None:
    """(continuation bytes, lowest, highest first continuation byte) after lead byte c."""
    if 0xC2 <= c <= 0xDF:
        return 1, 0x80, 0xBF
    if 0xE0 <= c <= 0xEF:
        return 2, 0xA0 if c == 0xE0 else 0x80, 0x9F if c == 0xED else 0xBF
    if 0xF0 <= c <= 0xF4:
        return 3, 0x90 if c == 0xF0 else 0x80, 0x8F if c == 0xF4 else 0xBF
    return None


def _value(stack: str, c: int) -> State | None:
    """The state after c opens a value, or None if it cannot."""
    if c == 0x22:  # "
        return _STRING, stack, 0, False, 0
    if c == 0x7B:  # {
        return _OBJECT_FIRST, stack + "{", 0, False, 0
    if c == 0x5B:  # [
        return _ARRAY_FIRST, stack + "[", 0, False, 0
    if c == 0x2D:  # -
        return _MINUS, stack, 0, False, 0
    if c == 0x30:  # 0
        return _ZERO, stack, 0, False, 0
    if c in _DIGITS:
        return _INT, stack, 0, False, 0
    if c in _LITERALS:
        return _LITERAL, stack, 0, False, _LITERALS[c]
    return None


def _after(stack: str, c: int) -> State | None:
    """The state after c follows a value, or None."""
    if c == 0x2C:  # ,
        return (_KEY if stack[-1] == "{" else _VALUE), stack, 0, False, 0
    if c == _CLOSE[stack[-1]]:
        return (_AFTER if len(stack) > 1 else _DONE), stack[:-1], 0, False, 0
    return None


def _step(state: State, c: int, max_whitespace: int) -> State | None:
    """The state after byte c, or None if no JSON object starts with the bytes so far + c."""
    mode, stack, ws, key, aux = state
    if mode == _STRING:
        if c == 0x22:
            return (_COLON if key else _AFTER), stack, 0, False, 0
        if c == 0x5C:  # backslash
            return _ESCAPE, stack, 0, key, 0
        if c < 0x20:  # control characters must be escaped
            return None
        if c < 0x80:
            return state
        lead = _utf8_lead(c)
        return None if lead is None else (_UTF8, stack, 0, key, lead)
    if mode == _UTF8:
        left, lo, hi = aux
        if not lo <= c <= hi:
            return None
        if left > 1:
            return _UTF8, stack, 0, key, (left - 1, 0x80, 0xBF)
        return _STRING, stack, 0, key, 0
    if mode == _ESCAPE:
        if c not in _ESCAPES:
            return None
        return (_HEX, stack, 0, key, 4) if c == 0x75 else (_STRING, stack, 0, key, 0)
    if mode == _HEX:
        if c not in _HEX_DIGITS:
            return None
        return (_HEX, stack, 0, key, aux - 1) if aux > 1 else (_STRING, stack, 0, key, 0)
    if _MINUS <= mode <= _EXP:
        nxt = _number(mode, c)
        if nxt is not None:
            return nxt, stack, 0, False, 0
        if mode not in _NUMBER_END:
            return None
        mode = _AFTER  # the number ended: c must follow a value
    if mode == _LITERAL:
        if c != aux[0]:
            return None
        if len(aux) > 1:
            return _LITERAL, stack, 0, False, aux[1:]
        return _AFTER, stack, 0, False, 0
    if mode == _DONE:
        return None
    if c in _WHITESPACE:
        return None if ws >= max_whitespace else (mode, stack, ws + 1, False, 0)
    if mode == _AFTER:
        return _after(stack, c)
    if mode == _COLON:
        return (_VALUE, stack, 0, False, 0) if c == 0x3A else None
    if mode == _START:
        return (_OBJECT_FIRST, "{", 0, False, 0) if c == 0x7B else None
    if c == 0x22 and mode in (_OBJECT_FIRST, _KEY):
        return _STRING, stack, 0, True, 0
    if mode == _OBJECT_FIRST and c == 0x7D:
        return _after(stack, c)
    if mode == _ARRAY_FIRST and c == 0x5D:
        return _after(stack, c)
    if mode in (_VALUE, _ARRAY_FIRST):
        return _value(stack, c)
    return None


def _number(mode: int, c: int) -> int | None:
    """The number mode after c, or None if c does not continue the number."""
    if c in _DIGITS:
        if mode == _MINUS:
            return _ZERO if c == 0x30 else _INT
        return None if mode == _ZERO else _DIGIT_NEXT[mode]  # no leading zeros
    if c == 0x2E:  # .
        return _DOT if mode in (_ZERO, _INT) else None
    if c in (0x45, 0x65):  # E e
        return _EXP_MARK if mode in (_ZERO, _INT, _FRAC) else None
    if c in (0x2B, 0x2D):  # + -
        return _EXP_SIGN if mode == _EXP_MARK else None
    return None


def _feed(state: State | None, data: bytes, max_whitespace: int) -> State | None:
    for c in data:
        if state is None:
            return None
        state = _step(state, c, max_whitespace)
    return state


_IN_STRING: State = (_STRING, "{", 0, False, 0)


def plain_string_content(data: bytes) -> bool:
    """Bytes that may stand anywhere inside a JSON string, whatever surrounds it: no quote
    (they cannot leave the string, so the stack and key are irrelevant), and no "<" (so a
    forced tool call's arguments need not watch them for </tool_call>)."""
    return not {0x22, 0x3C} & set(data) and _feed(_IN_STRING, data, 0) == _IN_STRING


class ByteValidator(ABC):
    """An incremental validator of a byte language, as a pure transition function `step` over
    hashable states: `Vocabulary.allowed` walks its token tries with `step`, and caches the
    result under `cache_key`. JsonValidator and tool_constraint's ToolCallValidator are two."""

    state: Hashable

    @abstractmethod
    def step(self, state: Any, c: int) -> Any | None:
        """The state after byte c, or None if no accepted string starts with what led to
        `state` + c."""

    @property
    @abstractmethod
    def complete(self) -> bool:
        """Whether the bytes so far are a whole accepted string (only EOS may follow)."""

    @property
    @abstractmethod
    def plain_rejected(self) -> bytes | None:
        """Inside a JSON string, where plain tokens (string content without a quote or "<")
        are accepted: b"", or the bytes that those starting with are not; elsewhere None."""

    @property
    @abstractmethod
    def cache_key(self) -> Hashable:
        """The state plus everything that sets the language, e.g. the whitespace bound."""

    def _feed(self, data: bytes) -> Any | None:
        state = self.state
        for c in data:
            state = self.step(state, c)
            if state is None:
                return None
        return state

    def accepts(self, data: bytes) -> bool:
        """Whether `data` may follow what was advanced so far; changes nothing."""
        return self._feed(data) is not None

    def advance(self, data: bytes) -> None:
        """Appends `data`; raises ValueError (and changes nothing) if it is not accepted."""
        state = self._feed(data)
        if state is None:
            raise ValueError(f"{data!r} cannot continue the constrained output")
        self.state = state


class JsonValidator(ByteValidator):
    """An incremental validator for UTF-8 JSON text whose top-level value is an object.

    A pushdown automaton: it accepts exactly the byte strings that are prefixes of such a
    document, with at most `max_whitespace` whitespace bytes in a row outside strings and
    nothing after the closing brace. `complete` once the object has closed.
    """

    def __init__(self, max_whitespace: int = MAX_WHITESPACE) -> None:
        self.max_whitespace = max_whitespace
        self.state: State = _INITIAL

    def step(self, state: State, c: int) -> State | None:
        return _step(state, c, self.max_whitespace)

    @property
    def complete(self) -> bool:
        return self.state[0] == _DONE

    @property
    def plain_rejected(self) -> bytes | None:
        return b"" if self.state[0] == _STRING else None

    @property
    def cache_key(self) -> Hashable:
        return self.max_whitespace, self.state
