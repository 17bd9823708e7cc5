"""A function's parameter schema as a constraint on the arguments of a call to it, in the
spirit of xgrammar's strict mode (which vLLM's structured outputs use for forced calls): the
top-level keys are the declared properties in their declared order, optional ones skippable
and required ones not; each value starts as its declared JSON type allows, an
`integer` has no fraction or exponent, and an `enum` of strings is one of them. Deeper
structure and other string contents are left to the model.

Checked byte by byte alongside the JSON automaton (`json_validator._step`): `step_keys`
sees each byte with the JSON states before and after it, and keeps `KeysState` (where in the
declared order it is, the key or value being written) as its own immutable state.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from serving.engine.json_validator import (
    _AFTER,
    _COLON,
    _DONE,
    _EXP,
    _KEY,
    _MINUS,
    _OBJECT_FIRST,
    _VALUE,
)

# The bytes a value of each JSON Schema type may start with.
_FIRST_BYTES = {
    "string": b'"',
    "integer": b"-0123456789",
    "number": b"-0123456789",
    "boolean": b"tf",
    "null": b"n",
    "array": b"[",
    "object": b"{",
}
_WHITESPACE = frozenset(b" \t\n\r")

# (index in the declared order of the last key written, -1 before any; bytes of the key being
# written or None; the key whose value is being written or None; the bytes of that value so
# far where its schema lists string values, else None)
KeysState = tuple[int, bytes | None, bytes | None, bytes | None]
INITIAL_KEYS: KeysState = (-1, None, None, None)


@dataclass(frozen=True)
class ValueSpec:
    """What a top-level value's schema checks: the bytes it may start with (its `type`s), for
    an `integer` no fraction or exponent, and for an `enum` of strings one of them exactly
    (their JSON encodings, quotes included)."""

    first_bytes: bytes | None
    integer: bool
    enum: tuple[bytes, ...] | None

    @classmethod
    def from_schema(cls, spec: Any) -> "ValueSpec | None":
        if not isinstance(spec, dict):
            return None
        types = spec.get("type")
        types = [types] if isinstance(types, str) else types
        first = None
        if isinstance(types, list) and all(t in _FIRST_BYTES for t in types):
            first = b"".join(_FIRST_BYTES[t] for t in types)
        enum = spec.get("enum")
        strings = None
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            strings = tuple(json.dumps(v, ensure_ascii=False).encode() for v in enum)
        value = cls(first, types == ["integer"], strings)
        return None if value == cls(None, False, None) else value


@dataclass(frozen=True)
class ArgumentKeys:
    """What a function's schema allows at the top level of its arguments object: its keys in
    their declared order (as xgrammar writes them), optional ones skippable, required ones
    not. Keys are the bytes between their quotes, as `json.dumps` writes them."""

    order: tuple[bytes, ...]
    required: frozenset[bytes]
    values: tuple[tuple[bytes, ValueSpec], ...]  # (key, what its value must be)
    # Looked up for every byte a mask walk tries: precomputed. following[last + 1]: the keys
    # that may follow the key at index `last`, the later ones up to the first required one.
    following: tuple[tuple[bytes, ...], ...] = field(init=False, compare=False, repr=False)
    value_of: dict[bytes, ValueSpec] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        following = []
        for start in range(len(self.order) + 1):
            rest = self.order[start:]
            first = next((i for i, k in enumerate(rest) if k in self.required), len(rest) - 1)
            following.append(rest[: first + 1])
        object.__setattr__(self, "following", tuple(following))
        object.__setattr__(self, "value_of", dict(self.values))

    @classmethod
    def from_schema(cls, schema: Mapping[str, Any] | None) -> "ArgumentKeys | None":
        """None where the schema leaves the keys open: no `properties`, or additional
        properties allowed explicitly."""
        if not schema or not isinstance(schema.get("properties"), dict):
            return None
        if schema.get("additionalProperties") not in (None, False):
            return None
        properties: dict[str, Any] = schema["properties"]

        def encode(key: str) -> bytes:
            return json.dumps(key, ensure_ascii=False)[1:-1].encode()

        values = []
        for key, spec in properties.items():
            value = ValueSpec.from_schema(spec)
            if value is not None:
                values.append((encode(key), value))
        required = [k for k in schema.get("required", []) if k in properties]
        return cls(tuple(map(encode, properties)), frozenset(map(encode, required)), tuple(values))

    def next_keys(self, last: int) -> tuple[bytes, ...]:
        """The keys that may follow the key at index `last` (-1: the first key)."""
        return self.following[last + 1]

    def step_keys(self, keys: KeysState, before: tuple, after: tuple, c: int) -> KeysState | None:
        """The keys' state after byte c took the JSON automaton from `before` to `after`
        (both valid), or None if the schema forbids c there."""
        last, key, value_of, written = keys
        if before[1] != "{":  # below the top level (inside a value): nothing to check
            return keys
        if key is not None:  # inside a top-level key
            if after[0] == _COLON:  # its closing quote
                if key not in self.next_keys(last):
                    return None
                return self.order.index(key), None, key, None
            key += bytes((c,))
            if not any(k.startswith(key) for k in self.next_keys(last)):
                return None
            return last, key, None, None
        mode = before[0]
        if mode in (_OBJECT_FIRST, _KEY) and c == 0x22:  # a key opens
            return (last, b"", None, None) if self.next_keys(last) else None
        if after[0] == _DONE:  # the object closes
            if self.required & set(self.order[last + 1 :]):
                return None
            return last, None, None, None
        if c == 0x2C and after[0] == _KEY:  # "," before another key
            return (last, None, None, None) if self.next_keys(last) else None
        value = self.value_of.get(value_of) if value_of is not None else None
        if value is None or (mode == _VALUE and c in _WHITESPACE):
            return keys
        if mode == _VALUE:  # the value's first byte
            if value.first_bytes is not None and c not in value.first_bytes:
                return None
            written = b""
        elif value.integer and _MINUS <= mode <= _EXP and c in b".eE":
            return None
        if value.enum is None or written is None:
            return keys if mode != _VALUE else (last, None, value_of, None)
        written += bytes((c,))
        if after[0] == _AFTER:  # the string closed
            return (last, None, None, None) if written in value.enum else None
        if not any(v.startswith(written) for v in value.enum):
            return None
        return last, None, value_of, written


def argument_keys(parameters: Mapping[str, Mapping[str, Any]]) -> dict[str, ArgumentKeys]:
    """Each function's `ArgumentKeys`, for those whose schema constrains its keys."""
    shapes = {name: ArgumentKeys.from_schema(schema) for name, schema in parameters.items()}
    return {name: shape for name, shape in shapes.items() if shape is not None}
