"""The code domain: its op grammar, generated tasks, and the verifier against wrong,
malformed and adversarial programs (run for real in the sandbox)."""

import itertools
import random

import pytest

from tasks.base import MAX_DIFFICULTY, MIN_DIFFICULTY, play
from tasks.code import N_TESTS, CodeDomain, make_task, verify
from tasks.code_ops import OPS, OPS_BY_NAME

DOMAIN = CodeDomain()
SEEDS = range(3)


def sum_task():
    """A fixed task, solve(xs) = sum(xs), whose hidden tests start with [], [0], ..."""
    return make_task(0, 1, [{"op": "list_sum", "k": None}], random.Random(0))


def program(source: str) -> str:
    return f"```python\n{source}\n```"


def test_grammar_has_enough_well_formed_ops():
    assert len(OPS) >= 30
    assert len(OPS_BY_NAME) == len(OPS)
    for op in OPS:
        assert "{x}" in op.phrase and "{x}" in op.expr, op.name
        assert ("{k}" in op.phrase) == (op.k is not None) == ("{k}" in op.expr), op.name
        assert op.takes in ("int", "str", "list") and op.gives in ("int", "str", "list")
    assert {(op.takes, op.gives) for op in OPS} >= {("list", "int"), ("str", "str"), ("int", "int")}


def test_every_op_reference_passes_its_own_hidden_tests():
    rng = random.Random(1)
    for op in OPS:
        chain = [{"op": op.name, "k": rng.randint(*op.k) if op.k else None}]
        task = make_task(0, 1, chain, rng)
        verdict = verify(task, DOMAIN.reference(task, "short")[0])
        assert verdict.reward == 1.0, (op.name, verdict.reason)


def test_generation_is_deterministic_and_shaped_by_difficulty():
    for difficulty in range(MIN_DIFFICULTY, MAX_DIFFICULTY + 1):
        for seed in range(20):
            task = DOMAIN.generate(seed, difficulty)
            assert task == DOMAIN.generate(seed, difficulty)
            chain = [OPS_BY_NAME[step["op"]] for step in task.data["chain"]]
            assert len(chain) == difficulty
            assert all(a.gives == b.takes for a, b in itertools.pairwise(chain))
            assert len(task.data["tests"]) >= 8
            assert 2 <= task.prompt.count("solve(") - 1 <= 3  # the examples, after the head
    assert DOMAIN.generate(0, 2).prompt != DOMAIN.generate(1, 2).prompt
    with pytest.raises(ValueError):
        DOMAIN.generate(0, 4)


def test_hidden_tests_include_edge_cases():
    inputs = [arg for arg, _ in sum_task().data["tests"]]
    assert len(inputs) == N_TESTS and [] in inputs
    assert any(v < 0 for arg in inputs for v in arg)


@pytest.mark.parametrize("style", ["short", "think"])
def test_references_score_one_at_every_difficulty(style):
    for difficulty in range(MIN_DIFFICULTY, MAX_DIFFICULTY + 1):
        for seed in SEEDS:
            task = DOMAIN.generate(seed, difficulty)
            turns = DOMAIN.reference(task, style)
            assert turns[0].startswith("<think>") == (style == "think")
            episode, verdict = play(DOMAIN, task, turns)
            assert verdict.reward == 1.0, (seed, difficulty, verdict.reason)
            assert episode.messages[-1] == {"role": "assistant", "content": turns[0]}


def test_partial_credit_and_failure_reasons():
    task = sum_task()
    verdict = verify(task, program("def solve(xs):\n    return sum(xs) if xs else 1"))
    assert verdict.reward == pytest.approx(0.9)
    assert verdict.reason == "1/10 tests failed: solve([]) returned 1, expected 0"
    verdict = verify(task, program("def solve(xs):\n    return None"))
    assert verdict.reward == 0.0
    assert verdict.reason.startswith("10/10 tests failed: solve([]) returned None, expected 0")
    wrong_type = verify(task, program("def solve(xs):\n    return str(sum(xs))"))
    assert wrong_type.reward == 0.0 and "returned '0', expected 0" in wrong_type.reason
    as_float = verify(task, program("def solve(xs):\n    return float(sum(xs))"))
    assert as_float.reward == 0.0 and "returned 0.0, expected 0" in as_float.reason
    raises = verify(task, program("def solve(xs):\n    return xs[0]"))
    assert "solve([]) raised IndexError" in raises.reason
    assert 0.0 < raises.reward < 1.0


def test_malformed_answers():
    task = sum_task()
    assert verify(task, program("def solve(xs:\n    return 0")).reason.startswith("syntax error")
    assert verify(task, program("def answer(xs):\n    return sum(xs)")).reason == (
        "no solve function"
    )
    assert verify(task, "<think>the sum, surely</think>").reason == "no solve function"
    bare = verify(task, "def solve(xs):\n    return sum(xs)\n")  # no block: the whole answer
    assert bare.reward == 1.0
    last_block_wins = (
        program("def solve(xs):\n    return 0")
        + "\n"
        + program("def solve(xs):\n    return sum(xs)")
    )
    assert verify(task, last_block_wins).reward == 1.0


def test_printing_the_expected_outputs_does_not_count():
    task = sum_task()
    expected = [out for _, out in task.data["tests"]]
    source = f"def solve(xs):\n    for v in {expected!r}:\n        print(v)\n"
    verdict = verify(task, program(source))
    assert verdict.reward == 0.0 and "returned None" in verdict.reason


def test_forged_summary_gains_nothing_even_with_the_nonce():
    # The nonce lives in the harness's memory, which the candidate shares; what it cannot
    # reach is the expected outputs, so a forged summary is judged on the values it claims.
    source = """
import __main__, json, os
claims = [{"type": "int", "value": 0, "repr": "0"}] * 10
os.write(1, (__main__.nonce + json.dumps({"results": claims}) + "\\n").encode())
os._exit(0)
"""
    verdict = verify(sum_task(), program(source))
    assert verdict.reward < 0.5 and "expected" in verdict.reason


def test_malformed_forged_summary_is_rejected():
    source = """
import __main__, os
os.write(1, (__main__.nonce + '{"results": [{"value": 0}]}\\n').encode())
os._exit(0)
"""
    verdict = verify(sum_task(), program(source))
    assert verdict.reward == 0.0 and "before reporting valid results" in verdict.reason


def test_overwriting_the_harness_has_no_effect():
    source = """
import sys
for path in (sys.argv[0], "main.py", "/prog/main.py"):
    try:
        with open(path, "w") as f:
            f.write("print('all tests passed')")
    except OSError:
        pass

def solve(xs):
    return None
"""
    task = sum_task()
    verdict = verify(task, program(source))
    assert verdict.reward == 0.0 and "returned None" in verdict.reason
    assert verify(task, DOMAIN.reference(task, "short")[0]).reward == 1.0


def test_early_exit_is_caught():
    task = sum_task()
    at_import = verify(task, program("import sys\nsys.exit(0)\ndef solve(xs):\n    return 0"))
    assert (
        at_import.reward == 0.0 and at_import.reason == "loading the program raised SystemExit: 0"
    )
    in_solve = verify(task, program("import sys\ndef solve(xs):\n    sys.exit(0)"))
    assert in_solve.reward == 0.0 and "raised SystemExit" in in_solve.reason
    hard = verify(task, program("import os\ndef solve(xs):\n    os._exit(0)"))
    assert hard.reason == "the program exited before reporting valid results (exit code 0)"


def test_monkeypatched_builtins_do_not_fool_the_harness():
    source = """
import builtins, json
json.dumps = lambda *a, **k: '{"results": []}'
builtins.print = lambda *a, **k: None
builtins.type = lambda v: int
builtins.repr = lambda v: "0"

def solve(xs):
    return None
"""
    verdict = verify(sum_task(), program(source))
    assert verdict.reward == 0.0 and "expected" in verdict.reason


def test_infinite_loops_time_out():
    task = sum_task()
    in_solve = verify(task, program("def solve(xs):\n    while True:\n        pass"))
    assert in_solve.reward == 0.0 and in_solve.reason == "10/10 tests failed: solve([]) timed out"
    at_import = verify(task, program("while True:\n    pass"))
    assert at_import.reward == 0.0 and at_import.reason == "loading the program timed out"
