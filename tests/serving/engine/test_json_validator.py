"""The incremental JSON validator against json.loads: every prefix of a valid document is
accepted, an invalid one is refused at its first bad byte."""

import json
import random

import pytest

from serving.engine.json_validator import MAX_WHITESPACE, JsonValidator

VALID = [
    "{}",
    ' \n\t\r{ "a" : 1 }',
    '{"a":1}',
    '{"": ""}',
    '{"a": -0.5e+10, "b": [true, false, null], "c": {"d": []}, "e": {}}',
    '{"n": [0, -0, 1, 10, 1.0, 1e5, 1E-5, -1.25e+3, 0.000, 2e0, 3.5E+07]}',
    '{"esc": "\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u00e9 \\uD83D\\uDE00 \\ud800"}',
    '{"utf8": "héllo wörld 日本語 😀 \x7f"}',
    '{"deep": [[[[{"x": [[]]}]]]]}',
    '{"a":[],"b":{},"a":"dup keys are valid JSON"}',
]

# (text, index of the first byte no JSON object can continue with)
INVALID = [
    ("[]", 0),
    ('"a"', 0),
    ("1", 0),
    ("x{}", 0),
    ("{'a': 1}", 1),
    ("{a: 1}", 1),
    ("{,}", 1),
    ('{"a" 1}', 5),
    ('{"a"::1}', 5),
    ('{"a":01}', 6),
    ('{"a":1.}', 7),
    ('{"a":-}', 6),
    ('{"a":.5}', 5),
    ('{"a":+1}', 5),
    ('{"a":1e+}', 8),
    ('{"a":1 2}', 7),
    ('{"a":1,}', 7),
    ('{"a":[1,]}', 8),
    ('{"a":tru}', 8),
    ('{"a":true1}', 9),
    ('{"a":NaN}', 5),
    ('{"a":Infinity}', 5),
    ('{"a":"\\x"}', 7),
    ('{"a":"\\u12G4"}', 10),
    ('{"a":"\x01"}', 6),
    ('{"a":"tab\there"}', 9),
    ('{"a":1}}', 7),
    ("{}{}", 2),
    ('{"a":[1}', 7),
    ('{"a":{]', 6),
]


def first_rejected(data: bytes) -> int | None:
    """Index of the first byte the validator rejects, None if it accepts all of `data`."""
    v = JsonValidator()
    for i in range(len(data)):
        if not v.accepts(data[i : i + 1]):
            return i
        v.advance(data[i : i + 1])
    return None


def complete(data: bytes) -> bool:
    v = JsonValidator()
    return v.accepts(data) and (v.advance(data) or v.complete)


def reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def is_json_object(text: str) -> bool:
    """json.loads's verdict, without its NaN and Infinity extension, and minus trailing
    whitespace, which the validator refuses."""
    try:
        value = json.loads(text, parse_constant=reject_constant)
    except ValueError:  # JSONDecodeError included
        return False
    return isinstance(value, dict) and text == text.rstrip(" \t\n\r")


# -- the validator -------------------------------------------------------------------------


@pytest.mark.parametrize("text", VALID)
def test_valid_documents_and_all_their_prefixes_are_accepted(text):
    assert is_json_object(text)
    data = text.encode()
    for k in range(len(data)):  # byte prefixes: some end inside a UTF-8 character
        v = JsonValidator()
        v.advance(data[:k])
        assert not v.complete
        assert v.accepts(data[k:])
    assert complete(data)


@pytest.mark.parametrize(("text", "bad"), INVALID)
def test_invalid_documents_are_rejected_at_the_first_bad_byte(text, bad):
    assert not is_json_object(text)
    assert first_rejected(text.encode()) == bad


def test_accepts_does_not_advance_and_advance_refuses_whole():
    v = JsonValidator()
    assert v.accepts(b'{"a"') and v.accepts(b"{") and not v.complete
    v.advance(b'{"a":')
    with pytest.raises(ValueError):
        v.advance(b"1}x")
    assert v.accepts(b"2}") and not v.complete
    v.advance(b"[]}")
    assert v.complete


def test_nothing_follows_the_object_not_even_whitespace():
    assert json.loads("{} ") == {}  # json.loads allows it; the model must stop instead
    for tail in (b" ", b"\n", b"{}", b","):
        assert first_rejected(b"{}" + tail) == 2


def test_whitespace_outside_strings_is_bounded():
    run = b" " * MAX_WHITESPACE
    assert complete(run + b"{" + run + b'"a"' + run + b":" + run + b"1" + run + b"}")
    assert first_rejected(run + b" {}") == MAX_WHITESPACE
    assert first_rejected(b'{"a":1' + run + b"\n}") == 6 + MAX_WHITESPACE
    assert complete(b'{"a": "' + b" " * 1000 + b'"}')  # inside strings it is content


@pytest.mark.parametrize(
    ("data", "bad"),
    [
        (b'{"a":"\xc3\xa9\xe6\x97\xa5\xf0\x9f\x98\x80"}', None),
        (b'{"a":"\xc3"}', 7),  # truncated character
        (b'{"a":"\x80"}', 6),  # continuation byte without a lead
        (b'{"a":"\xc0\x80"}', 6),  # overlong
        (b'{"a":"\xe0\x80\x80"}', 7),  # overlong
        (b'{"a":"\xed\xa0\x80"}', 7),  # surrogate
        (b'{"a":"\xf4\x90\x80\x80"}', 7),  # past U+10FFFF
        (b'{"a":"\xf5"}', 6),
        (b'{"\xc3\xa9":1}', None),
        (b'{"a":1\xc3\xa9}', 6),  # non-ASCII only inside strings
    ],
)
def test_strings_must_be_utf8(data, bad):
    assert first_rejected(data) == bad


def random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.choice("dlsifbn" if depth < 4 else "sifbn")
    if kind == "d":
        return {
            random_value(rng, 9): random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))
        }
    if kind == "l":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "s":
        alphabet = 'ab "\\/\n\t\x00\x1f\x7fé日😀'
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
    if kind == "i":
        return rng.choice([0, -1, 7, 10**20, -(10**12)])
    if kind == "f":
        return rng.choice([0.5, -2.5e-7, 1e300, 123.456, -0.0])
    return rng.choice([True, False, None])


def test_random_documents_and_their_prefixes_are_accepted():
    rng = random.Random(0)
    for _ in range(300):
        doc = {random_value(rng, 9): random_value(rng) for _ in range(rng.randint(0, 4))}
        text = json.dumps(
            doc,
            ensure_ascii=rng.random() < 0.5,
            indent=rng.choice([None, 1, 2]),
            separators=rng.choice([None, (",", ":")]),
        )
        assert first_rejected(text.encode()) is None and complete(text.encode()), text


def greedy_completion(v: JsonValidator) -> bytes:
    """Bytes that close whatever `v` has open, found through `accepts` alone."""
    out = b""
    order = [b'"', b"}", b"]", b"0", b":", *(bytes([c]) for c in b"ruealsn{"), b"\x80", b"\xa0"]
    for _ in range(200):
        if v.complete:
            return out
        c = next(c for c in order if v.accepts(c))
        v.advance(c)
        out += c
    raise AssertionError("no completion")


def test_random_strings_agree_with_json_loads_and_accepted_prefixes_complete():
    rng = random.Random(1)
    alphabet = [*'{}[]":,0123456789-+.eEtrufalsn \\u\n\t', "é", "日", "\x01"]
    agreed = completed = 0
    for _ in range(30000):
        text = "{" + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        data = text.encode()
        assert complete(data) == is_json_object(text), text
        agreed += is_json_object(text)
        v = JsonValidator()
        if v.accepts(data):
            v.advance(data)
            data += greedy_completion(v)
            assert is_json_object(data.decode()), data
            completed += 1
    assert agreed > 50 and completed > 1000  # the fuzz does reach both kinds
