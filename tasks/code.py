"""Python functions described in words: write `solve`, checked by hidden tests in the sandbox.

A task is a chain of primitive operations on ints, strings and lists of ints ("keep the even
numbers", "take the sum"), each the input of the next, so only type-compatible chains exist.
Difficulty is the chain's length (1-3 operations). The prompt states the chain in words and
shows 2-3 examples; the answer is a ```python block that defines `solve`.

Verification never trusts the candidate process with the answers. The verifier writes the
candidate to `solution.py` in a fresh sandbox and runs `HARNESS`, which reads the hidden inputs
and a per-verification random nonce from stdin (before the candidate's code runs), imports
`solve`, calls it on each input under a per-call time limit and prints one JSON summary of
what `solve` returned, prefixed by the nonce, as its last stdout line. The expected outputs
never leave this process: the verifier compares them with the returned values itself. So a
program that prints answers, exits early, overwrites the harness file or patches builtins
can at best report values it computed, which is what solving the task means.

Reward is the fraction of hidden tests passed (1.0 only when all pass); a program that does
not parse, has no `solve`, or gives no summary (crash, timeout) scores 0.
"""

import ast
import json
import random
import secrets
import threading
from typing import Any

from tasks.answers import extract_program, reasoning_block
from tasks.base import (
    MAX_DIFFICULTY,
    MIN_DIFFICULTY,
    Domain,
    Episode,
    Style,
    Task,
    Verdict,
)
from tasks.code_ops import EDGE_CASES, OPS_BY_NAME, apply_chain, draw_chain
from tasks.sandbox import Limits, run_code

N_TESTS = 10
CASE_TIMEOUT_S = 1.0  # per call of solve; the sandbox's wall clock bounds the whole run
LIMITS = Limits(timeout_s=10.0, cpu_s=10, memory_mb=512)
PARAM = {"int": "n", "str": "s", "list": "xs"}
DESCRIBE = {"int": "an integer", "str": "a string", "list": "a list of integers"}
STEP_NAMES = ("a", "b")


HARNESS = r'''
import contextlib, copy, importlib.util, io, json, os, signal, sys

_write, _dumps, _exc = os.write, json.dumps, BaseException
request = json.loads(sys.stdin.read())
nonce = request.pop("nonce")


class CaseTimeout(BaseException):
    pass


def on_alarm(signum, frame):
    raise CaseTimeout


def report(summary):
    _write(1, ("\n" + nonce + _dumps(summary) + "\n").encode())
    os._exit(0)


def guarded(fn, limit):
    """Run fn with stray output swallowed and a time limit; (value, error text or None)."""
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return fn(), None
    except CaseTimeout:
        return None, "timed out"
    except _exc as e:
        return None, f"raised {type(e).__name__}: {e}"[:300]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def load():
    spec = importlib.util.spec_from_file_location("solution", "solution.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


module, error = guarded(load, 2 * request["case_timeout_s"])
if error:
    report({"error": f"loading the program {error}"})
solve = getattr(module, "solve", None)
if not callable(solve):
    report({"error": "no solve function"})
results = []
for arg in request["inputs"]:
    value, error = guarded(lambda: solve(copy.deepcopy(arg)), request["case_timeout_s"])
    if error is None:
        try:
            text = _dumps(value)
            error = "returned a value too large to report" if len(text) > 10_000 else None
        except _exc:
            error = f"returned {type(value).__name__} {repr(value)[:100]}, not a JSON value"
    if error:
        results.append({"error": error})
        if error == "timed out":
            break
    else:
        results.append({"type": type(value).__name__, "value": value, "repr": repr(value)[:100]})
report({"results": results})
'''


def step_names(chain: list[dict[str, Any]]) -> list[str]:
    """The parameter's name, then one name per intermediate value ("xs", "a", "b")."""
    return [PARAM[OPS_BY_NAME[chain[0]["op"]].takes], *STEP_NAMES[: len(chain) - 1]]


def phrases(chain: list[dict[str, Any]]) -> list[str]:
    """Each step in words, about the previous step's name."""
    names = step_names(chain)
    return [
        OPS_BY_NAME[s["op"]].render(OPS_BY_NAME[s["op"]].phrase, names[i], s["k"])
        for i, s in enumerate(chain)
    ]


def reference_source(chain: list[dict[str, Any]]) -> str:
    """`def solve` computing the chain one named step at a time."""
    names = step_names(chain)
    lines = [f"def solve({names[0]}):"]
    for i, step in enumerate(chain):
        op = OPS_BY_NAME[step["op"]]
        expr = op.render(op.expr, names[i], step["k"])
        last = i == len(chain) - 1
        lines.append(f"    return {expr}" if last else f"    {names[i + 1]} = {expr}")
    return "\n".join(lines) + "\n"


def describe(chain: list[dict[str, Any]]) -> str:
    """The task in words: one sentence for a single op, otherwise one "Let" per step."""
    names, said = step_names(chain), phrases(chain)
    kind = DESCRIBE[OPS_BY_NAME[chain[0]["op"]].takes]
    head = f"Write a Python function solve({names[0]}), where {names[0]} is {kind}"
    if len(chain) == 1:
        return f"{head}, that returns {said[0]}."
    lets = " ".join(f"Let {names[i + 1]} be {said[i]}." for i in range(len(chain) - 1))
    return f"{head}. {lets} solve returns {said[-1]}."


def _call(arg: Any) -> str:
    return f"solve({arg!r})"


def make_task(seed: int, difficulty: int, chain: list[dict[str, Any]], rng: random.Random) -> Task:
    """A task for a given chain: hidden tests (edge cases first) and prompt examples."""
    first = OPS_BY_NAME[chain[0]["op"]]
    inputs: list[Any] = []
    for arg in [*EDGE_CASES[first.takes], *(first.draw_input(rng) for _ in range(4 * N_TESTS))]:
        if arg not in inputs:
            inputs.append(arg)
    inputs = inputs[:N_TESTS]
    tests = [[arg, apply_chain(chain, arg)] for arg in inputs]
    examples = [first.draw_input(rng) for _ in range(rng.choice((2, 3)))]
    shown = "\n".join(f"{_call(a)} == {apply_chain(chain, a)!r}" for a in examples)
    prompt = (
        f"{describe(chain)}\n\nExamples:\n{shown}\n\n"
        "Answer with the complete function in a ```python block."
    )
    data = {
        "chain": chain,
        "returns": OPS_BY_NAME[chain[-1]["op"]].gives,
        "source": reference_source(chain),
        "tests": tests,
        "examples": [[a, apply_chain(chain, a)] for a in examples],
    }
    return Task("code", seed, difficulty, prompt, data)


def _summary(stdout: str, nonce: str) -> dict[str, Any] | None:
    """The harness's last nonce-prefixed line, if it is a summary of the expected shape."""
    lines = [line for line in stdout.splitlines() if line.startswith(nonce)]
    if not lines:
        return None
    try:
        summary = json.loads(lines[-1][len(nonce) :])
    except json.JSONDecodeError:
        return None
    if not isinstance(summary, dict):
        return None
    if isinstance(summary.get("error"), str):
        return summary
    results = summary.get("results")
    if not isinstance(results, list) or not all(map(_well_formed, results)):
        return None
    return summary


def _well_formed(result: Any) -> bool:
    if not isinstance(result, dict):
        return False
    if "error" in result:
        return isinstance(result["error"], str)
    return {"type", "value", "repr"} <= result.keys() and isinstance(result["repr"], str)


def _canonical(value: Any) -> str:
    """JSON text, so 1.0 differs from 1 and True from 1 even inside lists."""
    return json.dumps(value, sort_keys=True)


# CPython 3.11 keeps the AST constructor's recursion depth in interpreter-wide state, and
# `ast.parse` on two threads at once failed with "SystemError: AST constructor recursion
# depth mismatch" (python/cpython#106905): the data pipeline verifies reference answers on
# threads of its own.
_AST_LOCK = threading.Lock()


def parse_python(source: str) -> ast.Module:
    """`ast.parse`, one thread at a time."""
    with _AST_LOCK:
        return ast.parse(source)


def verify(task: Task, completion: str) -> Verdict:
    """Run the candidate on the hidden tests in the sandbox and compare here."""
    program = extract_program(completion)
    try:
        parse_python(program)
    except SyntaxError as e:
        return Verdict(0.0, f"syntax error (line {e.lineno}: {e.msg})")
    except ValueError as e:  # null bytes in the source
        return Verdict(0.0, f"syntax error ({e})")
    tests = task.data["tests"]
    nonce = secrets.token_hex(16)
    request = {
        "nonce": nonce,
        "inputs": [arg for arg, _ in tests],
        "case_timeout_s": CASE_TIMEOUT_S,
    }
    result = run_code(
        "python",
        HARNESS,
        files={"solution.py": program},
        limits=LIMITS,
        stdin=json.dumps(request),
    )
    summary = _summary(result.stdout, nonce)
    if summary is None:
        if result.status in ("timeout", "killed", "output_limit"):
            return Verdict(0.0, f"{result.status.replace('_', ' ')}: {result.reason}")
        why = f"exit code {result.exit_code}"
        return Verdict(0.0, f"the program exited before reporting valid results ({why})")
    if "error" in summary:
        return Verdict(0.0, summary["error"])
    failures = []
    for i, (arg, expected) in enumerate(tests):
        got = summary["results"][i] if i < len(summary["results"]) else {"error": "not run"}
        call = _call(arg)
        if "error" in got:
            failures.append(f"{call} {got['error']}")
        elif got["type"] != task.data["returns"] or _canonical(got["value"]) != _canonical(
            expected
        ):
            failures.append(f"{call} returned {got['repr']}, expected {expected!r}")
    passed = len(tests) - len(failures)
    metrics = {"tests": float(len(tests)), "passed": float(passed)}
    if not failures:
        return Verdict(1.0, f"all {len(tests)} tests passed", metrics)
    reason = f"{len(failures)}/{len(tests)} tests failed: {failures[0]}"
    return Verdict(passed / len(tests), reason, metrics)


class CodeEpisode(Episode):
    """One answer, verified when the episode is scored."""

    def __init__(self, task: Task) -> None:
        super().__init__(task)
        self.completion = ""

    def step(self, completion: str) -> bool:
        self.messages.append({"role": "assistant", "content": completion})
        self.completion, self.done = completion, True
        return True

    def verdict(self) -> Verdict:
        if not self.done:
            return Verdict(0.0, "no answer")
        return verify(self.task, self.completion)


class CodeDomain(Domain):
    name = "code"

    def generate(self, seed: int, difficulty: int) -> Task:
        """Chains whose reference gives fewer than 3 distinct outputs on the hidden tests
        (constant-like functions, which examples cannot pin down) are redrawn."""
        if not MIN_DIFFICULTY <= difficulty <= MAX_DIFFICULTY:
            raise ValueError(f"difficulty must be in {MIN_DIFFICULTY}..{MAX_DIFFICULTY}")
        rng = random.Random(f"code-{seed}-{difficulty}")
        while True:
            task = make_task(seed, difficulty, draw_chain(rng, difficulty), rng)
            outputs = {json.dumps(expected) for _, expected in task.data["tests"]}
            if len(outputs) >= 3:
                return task

    def reference(self, task: Task, style: Style) -> list[str]:
        answer = f"```python\n{task.data['source']}```"
        if style == "short":
            return [answer]
        chain = task.data["chain"]
        names = [*step_names(chain), "the result"]
        steps = [f"{i + 1}. {names[i + 1]} = {said}" for i, said in enumerate(phrases(chain))]
        kind = DESCRIBE[OPS_BY_NAME[chain[0]["op"]].takes]
        # No restated example: a small model decoding greedily loops on such a line.
        plan = "\n".join([f"{names[0]} is {kind}. Plan, one expression per step:", *steps])
        return [reasoning_block(plan) + answer]

    def start(self, task: Task) -> Episode:
        return CodeEpisode(task)
