"""A function's parameter schema as a constraint on the arguments of a call to it, in the
spirit of xgrammar's strict mode (which vLLM's structured outputs use for forced calls): the
top-level keys are the declared properties, each at most once, the required ones all
present before the object closes, and each value starts as its declared JSON type allows.
Deeper structure, string contents and enums are left to the model.

Checked byte by byte alongside the JSON automaton (`json_validator._step`): `step_keys`
sees each byte with the JSON states before and after it, and keeps (keys used, bytes of the
key being written) as its own immutable state.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from serving.engine.json_validator import _COLON, _DONE, _KEY, _OBJECT_FIRST, _VALUE

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

# (keys used, bytes of the key being written or None, the key whose value comes next or None)
KeysState = tuple[frozenset[bytes], bytes | None, bytes | None]
INITIAL_KEYS: KeysState = (frozenset(), None, None)


@dataclass(frozen=True)
class ArgumentKeys:
    """What a function's schema allows at the top level of its arguments object. Keys are
    the bytes between their quotes, as `json.dumps` writes them."""

    keys: frozenset[bytes]
    required: frozenset[bytes]
    first_bytes: tuple[tuple[bytes, bytes], ...]  # (key, bytes its value may start with)

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

        first = []
        for key, spec in properties.items():
            types = spec.get("type") if isinstance(spec, dict) else None
            types = [types] if isinstance(types, str) else types
            if isinstance(types, list) and all(t in _FIRST_BYTES for t in types):
                first.append((encode(key), b"".join(_FIRST_BYTES[t] for t in types)))
        required = [k for k in schema.get("required", []) if k in properties]
        return cls(
            frozenset(map(encode, properties)), frozenset(map(encode, required)), tuple(first)
        )

    def step_keys(self, keys: KeysState, before: tuple, after: tuple, c: int) -> KeysState | None:
        """The keys' state after byte c took the JSON automaton from `before` to `after`
        (both valid), or None if the schema forbids c there."""
        used, key, value_of = keys
        if before[1] != "{":  # below the top level: nothing to check
            return keys
        if key is not None:  # inside a top-level key
            if after[0] == _COLON:  # its closing quote
                return (used | {key}, None, key) if key in self.keys - used else None
            key += bytes((c,))
            return (used, key, None) if any(k.startswith(key) for k in self.keys - used) else None
        mode = before[0]
        if mode in (_OBJECT_FIRST, _KEY) and c == 0x22:  # a key opens
            return (used, b"", None) if self.keys - used else None
        if after[0] == _DONE:  # the object closes
            return keys if self.required <= used else None
        if c == 0x2C and after[0] == _KEY:  # "," before another key
            return keys if self.keys - used else None
        if mode == _VALUE and value_of is not None and c not in _WHITESPACE:
            allowed = next((b for k, b in self.first_bytes if k == value_of), None)
            return None if allowed is not None and c not in allowed else (used, None, None)
        return keys


def argument_keys(parameters: Mapping[str, Mapping[str, Any]]) -> dict[str, ArgumentKeys]:
    """Each function's `ArgumentKeys`, for those whose schema constrains its keys."""
    shapes = {name: ArgumentKeys.from_schema(schema) for name, schema in parameters.items()}
    return {name: shape for name, shape in shapes.items() if shape is not None}
