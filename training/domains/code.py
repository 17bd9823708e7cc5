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
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serving.reasoning import split_reasoning
from training.domains.base import (
    MAX_DIFFICULTY,
    MIN_DIFFICULTY,
    Domain,
    Episode,
    Style,
    Task,
    Verdict,
)
from training.sandbox import Limits, run_code

N_TESTS = 10
CASE_TIMEOUT_S = 1.0  # per call of solve; the sandbox's wall clock bounds the whole run
LIMITS = Limits(timeout_s=10.0, cpu_s=10, memory_mb=512)
PARAM = {"int": "n", "str": "s", "list": "xs"}
DESCRIBE = {"int": "an integer", "str": "a string", "list": "a list of integers"}
STEP_NAMES = ("a", "b")
CODE_BLOCK = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)

WORDS = ("apple", "Banana", "sky", "Echo", "quiz", "tree", "Ocean", "map", "idea", "rhythm")
EDGE_CASES: dict[str, list[Any]] = {
    "int": [0, -1, 7],
    "str": ["", "a", "Hello World"],
    "list": [[], [0], [-3, -3, 7, 0]],
}


def _int(rng: random.Random) -> int:
    return rng.randint(-1000, 1000)


def _big_int(rng: random.Random) -> int:
    """Wider ints for the digit operations, which are dull on small numbers."""
    return rng.randint(-(10**7), 10**7)


def _str(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(0, 4))]
    return " ".join(w.swapcase() if rng.random() < 0.2 else w for w in words)


def _list(rng: random.Random) -> list[int]:
    return [rng.randint(-20, 20) for _ in range(rng.randint(0, 8))]


INPUTS: dict[str, Callable[[random.Random], Any]] = {"int": _int, "str": _str, "list": _list}


@dataclass(frozen=True)
class Op:
    """One primitive: a noun phrase and a Python expression over `{x}` (and a constant `{k}`
    drawn from `k` when the op has one), the types it takes and gives, the generator of
    inputs that exercise it (its input type's when None), and a family: a chain never puts
    two ops of one family in a row, since the second would undo or repeat the first
    (sorting a sorted list, upper-casing a lower-cased string)."""

    name: str
    phrase: str
    expr: str
    takes: str
    gives: str
    k: tuple[int, int] | None = None
    inputs: Callable[[random.Random], Any] | None = None
    family: str = ""

    def render(self, template: str, x: str, k: int | None) -> str:
        return template.replace("{x}", x).replace("{k}", str(k))

    def draw_input(self, rng: random.Random) -> Any:
        return (self.inputs or INPUTS[self.takes])(rng)


VOWELS = "'aeiouAEIOU'"
OPS: tuple[Op, ...] = (
    # list -> int
    Op("list_sum", "the sum of {x}", "sum({x})", "list", "int"),
    Op("list_len", "the number of elements in {x}", "len({x})", "list", "int"),
    Op("list_max", "the largest number in {x} (0 if {x} is empty)",
       "max({x}, default=0)", "list", "int"),
    Op("list_min", "the smallest number in {x} (0 if {x} is empty)",
       "min({x}, default=0)", "list", "int"),
    Op("count_even", "how many numbers in {x} are even",
       "sum(1 for v in {x} if v % 2 == 0)", "list", "int"),
    Op("count_negative", "how many numbers in {x} are negative",
       "sum(1 for v in {x} if v < 0)", "list", "int"),
    Op("count_above", "how many numbers in {x} are greater than {k}",
       "sum(1 for v in {x} if v > {k})", "list", "int", (-5, 5)),
    Op("list_first", "the first number in {x} (0 if {x} is empty)",
       "{x}[0] if {x} else 0", "list", "int"),
    Op("list_last", "the last number in {x} (0 if {x} is empty)",
       "{x}[-1] if {x} else 0", "list", "int"),
    Op("count_distinct", "the number of distinct values in {x}", "len(set({x}))", "list", "int"),
    Op("list_spread", "the largest minus the smallest number in {x} (0 if {x} is empty)",
       "max({x}) - min({x}) if {x} else 0", "list", "int"),
    # list -> list
    Op("sort_up", "{x} sorted in ascending order", "sorted({x})", "list", "list",
       family="order"),
    Op("sort_down", "{x} sorted in descending order", "sorted({x}, reverse=True)", "list", "list",
       family="order"),
    Op("list_reverse", "{x} in reverse order", "{x}[::-1]", "list", "list", family="order"),
    Op("keep_even", "the even numbers in {x}, in order",
       "[v for v in {x} if v % 2 == 0]", "list", "list"),
    Op("keep_odd", "the odd numbers in {x}, in order",
       "[v for v in {x} if v % 2 != 0]", "list", "list"),
    Op("keep_positive", "the positive numbers in {x}, in order",
       "[v for v in {x} if v > 0]", "list", "list"),
    Op("each_times", "{x} with each number multiplied by {k}",
       "[v * {k} for v in {x}]", "list", "list", (2, 5)),
    Op("each_plus", "{x} with {k} added to each number",
       "[v + {k} for v in {x}]", "list", "list", (1, 9)),
    Op("each_squared", "{x} with each number squared", "[v * v for v in {x}]", "list", "list"),
    Op("each_abs", "{x} with each number replaced by its absolute value",
       "[abs(v) for v in {x}]", "list", "list"),
    Op("dedupe", "{x} without repeated values, keeping the first occurrence of each",
       "list(dict.fromkeys({x}))", "list", "list"),
    Op("drop_first", "{x} without its first element (empty if {x} is empty)",
       "{x}[1:]", "list", "list"),
    Op("running_total", "the running totals of {x} (item i is the sum of the first i + 1 numbers)",
       "[sum({x}[: i + 1]) for i in range(len({x}))]", "list", "list"),
    Op("take_first", "the first {k} elements of {x} (all of them if there are fewer)",
       "{x}[:{k}]", "list", "list", (1, 4)),
    # list -> str
    Op("join_commas", "the numbers in {x} joined by commas, with no spaces",
       "','.join(str(v) for v in {x})", "list", "str"),
    # int -> int
    Op("int_plus", "{x} plus {k}", "{x} + {k}", "int", "int", (1, 20)),
    Op("int_times", "{x} times {k}", "{x} * {k}", "int", "int", (2, 9)),
    Op("int_abs", "the absolute value of {x}", "abs({x})", "int", "int"),
    Op("int_square", "{x} squared", "{x} * {x}", "int", "int"),
    Op("int_negate", "{x} with its sign flipped", "-{x}", "int", "int"),
    Op("int_mod", "the remainder of {x} divided by {k} (as Python's % gives it)",
       "{x} % {k}", "int", "int", (2, 9)),
    Op("digit_sum", "the sum of the decimal digits of {x} (ignoring its sign)",
       "sum(int(c) for c in str(abs({x})))", "int", "int", inputs=_big_int),
    Op("digit_count", "the number of decimal digits of {x} (ignoring its sign)",
       "len(str(abs({x})))", "int", "int", inputs=_big_int),
    # int -> list, int -> str
    Op("digits", "the decimal digits of {x} as a list of integers (ignoring its sign)",
       "[int(c) for c in str(abs({x}))]", "int", "list", inputs=_big_int),
    Op("int_str", "{x} written in decimal as a string", "str({x})", "int", "str"),
    Op("binary", "the binary digits of the absolute value of {x} as a string, with no prefix",
       "bin(abs({x}))[2:]", "int", "str"),
    # str -> int
    Op("str_len", "the number of characters in {x}", "len({x})", "str", "int"),
    Op("count_vowels", "the number of vowels (a, e, i, o, u in either case) in {x}",
       f"sum(1 for c in {{x}} if c in {VOWELS})", "str", "int"),
    Op("count_upper", "the number of uppercase letters in {x}",
       "sum(1 for c in {x} if c.isupper())", "str", "int"),
    Op("count_words", "the number of words in {x} (separated by whitespace)",
       "len({x}.split())", "str", "int"),
    # str -> str
    Op("str_reverse", "{x} reversed", "{x}[::-1]", "str", "str", family="chars"),
    Op("str_upper", "{x} in upper case", "{x}.upper()", "str", "str", family="case"),
    Op("str_lower", "{x} in lower case", "{x}.lower()", "str", "str", family="case"),
    Op("no_spaces", "{x} with all spaces removed", "{x}.replace(' ', '')", "str", "str"),
    Op("no_vowels", "{x} with all vowels (a, e, i, o, u in either case) removed",
       f"''.join(c for c in {{x}} if c not in {VOWELS})", "str", "str"),
    Op("swap_case", "{x} with the case of every letter swapped", "{x}.swapcase()", "str", "str",
       family="case"),
    Op("sort_chars", "the characters of {x} sorted by code point",
       "''.join(sorted({x}))", "str", "str", family="chars"),
    Op("reverse_words", "the words of {x} in reverse order, joined by single spaces",
       "' '.join({x}.split()[::-1])", "str", "str"),
    Op("str_prefix", "the first {k} characters of {x} (all of it if it is shorter)",
       "{x}[:{k}]", "str", "str", (1, 5)),
    # str -> list
    Op("word_lengths", "the lengths of the words in {x} (separated by whitespace)",
       "[len(w) for w in {x}.split()]", "str", "list"),
    Op("char_codes", "the Unicode code points of the characters in {x}",
       "[ord(c) for c in {x}]", "str", "list"),
)  # fmt: skip
OPS_BY_NAME = {op.name: op for op in OPS}

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


def _apply_chain(chain: list[dict[str, Any]], value: Any) -> Any:
    """Evaluate a chain in this process (trusted: our own expressions) on one input."""
    for step in chain:
        op = OPS_BY_NAME[step["op"]]
        value = eval(op.render(op.expr, "_x", step["k"]), {"_x": value})
    return value


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
    tests = [[arg, _apply_chain(chain, arg)] for arg in inputs]
    examples = [first.draw_input(rng) for _ in range(rng.choice((2, 3)))]
    shown = "\n".join(f"{_call(a)} == {_apply_chain(chain, a)!r}" for a in examples)
    prompt = (
        f"{describe(chain)}\n\nExamples:\n{shown}\n\n"
        "Answer with the complete function in a ```python block."
    )
    data = {
        "chain": chain,
        "returns": OPS_BY_NAME[chain[-1]["op"]].gives,
        "source": reference_source(chain),
        "tests": tests,
        "examples": [[a, _apply_chain(chain, a)] for a in examples],
    }
    return Task("code", seed, difficulty, prompt, data)


def _same_family(a: Op, b: Op) -> bool:
    return a is b or (a.family != "" and a.family == b.family)


def _draw_chain(rng: random.Random, depth: int) -> list[dict[str, Any]]:
    """A random type-compatible chain with no family repeated back to back."""
    op = rng.choice(OPS)
    chain = [op]
    while len(chain) < depth:
        last = chain[-1]
        op = rng.choice([o for o in OPS if o.takes == last.gives and not _same_family(o, last)])
        chain.append(op)
    return [{"op": o.name, "k": rng.randint(*o.k) if o.k else None} for o in chain]


def extract_program(completion: str) -> str:
    """The last ```python block of the answer (reasoning dropped), else the whole answer."""
    _, content = split_reasoning(completion)
    blocks = CODE_BLOCK.findall(content)
    return blocks[-1] if blocks else content


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


def verify(task: Task, completion: str) -> Verdict:
    """Run the candidate on the hidden tests in the sandbox and compare here."""
    program = extract_program(completion)
    try:
        ast.parse(program)
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
            task = make_task(seed, difficulty, _draw_chain(rng, difficulty), rng)
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
        arg, expected = task.data["examples"][0]
        kind = DESCRIBE[OPS_BY_NAME[chain[0]["op"]].takes]
        plan = "\n".join(
            [
                f"{names[0]} is {kind}. Plan, one expression per step:",
                *steps,
                f"Check: solve({arg!r}) should give {expected!r}.",
            ]
        )
        return [f"<think>\n{plan}\n</think>\n\n{answer}"]

    def start(self, task: Task) -> Episode:
        return CodeEpisode(task)
