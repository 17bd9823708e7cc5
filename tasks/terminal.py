"""Shell tasks on a generated file tree, played one bash command per turn in a sandbox.

Protocol (the prompt states it too):

- The working directory holds logs/, src/, data/ and archive/ with generated files. It lives
  in one `Sandbox` for the whole episode, so files persist from command to command, but every
  command runs in a fresh bash process: `cd` and variables do not carry over.
- Each assistant turn (after any <think> reasoning) is either exactly one command in a
  ```bash block (```sh is accepted too), or a line `DONE` with no command block, which ends
  the episode.
- After a command (run under LIMITS: 5 s wall clock) the episode answers with a user message
  `Output:\\n<output>\\nExit code: N`, where the output is stdout then stderr, trailing
  newlines dropped, cut to OUTPUT_CHARS (2000) characters with a `[... N more characters]`
  note; for a command the sandbox stopped, N is `none (<status>: <reason>)`.
- Any other turn (no block, several blocks, an empty block, a block and DONE) gets an
  `Invalid turn: ...` message. It and every command the sandbox stopped (timeout, killed,
  output limit) or the shell could not run (exit code 126 or 127) count as invalid ops.
  A command that runs and exits non-zero (grep finding nothing) is ordinary feedback.
- Every turn counts as a step; the episode ends after MAX_STEPS (10) steps at the latest.

Verdict: the final tree (every regular file and its text, trailing newlines ignored) must
equal the tree computed in Python from the generated one, and every number the task asks
to print must appear, as a whole number, in the stdout of some command. Reward 1.0 when
both hold, else 0.0; metrics are steps, invalid_ops and finished (1.0 when it said DONE).

Difficulty: 1 is a flat tree of 2-4 files per directory and one task; 2 puts files in
subdirectories too, with more of them; 3 is a larger nested tree and two tasks on disjoint
directories.
"""

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from tasks.answers import parse_command_turn, reasoning_block
from tasks.base import (
    MAX_DIFFICULTY,
    MIN_DIFFICULTY,
    Domain,
    Episode,
    Style,
    Task,
    Verdict,
)
from tasks.sandbox import Limits, Sandbox, SandboxResult

MAX_STEPS = 10
OUTPUT_CHARS = 2000
LIMITS = Limits(timeout_s=5.0, cpu_s=5)
STOPPED = ("timeout", "killed", "output_limit")
CANNOT_RUN = (126, 127)  # not executable, command not found
# difficulty -> (files per directory, nested, number of tasks)
LEVELS = {1: ((2, 4), False, 1), 2: ((3, 6), True, 1), 3: ((5, 8), True, 2)}
SUBDIRS = {"logs": ("old", "web"), "src": ("util", "core"), "data": ("raw", "2024")}
WORDS = (
    "alpha", "beta", "cargo", "delta", "ember", "fjord", "grove", "harbor", "iris", "jade",
    "kite", "lumen", "maple", "nova", "orbit", "pixel", "quartz", "raven", "sierra", "tango",
)  # fmt: skip
LEVEL_NAMES = ("INFO", "WARN", "ERROR", "DEBUG")
MESSAGES = ("started", "request done", "cache miss", "disk full", "retrying", "error budget ok")

PROTOCOL = f"""\
Protocol: answer each turn with exactly one bash command in a ```bash block. It runs in the \
working directory and you get back "Output:" with its output, then "Exit code: N". Every \
command runs in a fresh shell (cd and variables do not carry over; files do). When the task \
is complete, answer with a line DONE and no command. You have at most {MAX_STEPS} turns."""


@dataclass
class Step:
    """One task template applied to a tree: what to ask, the tree it leaves, the number it
    must print (if any), and the commands and plan of the reference solution."""

    instruction: str
    tree: dict[str, str]
    printed: str | None
    commands: list[str]
    plan: str


def _where(top: str, nested: bool) -> str:
    return f"anywhere under {top}/ (including its subdirectories)" if nested else f"in {top}/"


def _files(tree: dict[str, str], top: str, suffix: str = "") -> list[str]:
    return sorted(p for p in tree if p.startswith(f"{top}/") and p.endswith(suffix))


def _basename(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def move_logs(tree: dict[str, str], nested: bool) -> Step:
    logs = _files(tree, "logs", ".log")
    after = {p: t for p, t in tree.items() if p not in logs}
    after.update({f"archive/{_basename(p)}": tree[p] for p in logs})
    return Step(
        f"Move every .log file {_where('logs', nested)} directly into archive/ and print how "
        "many files you moved.",
        after,
        str(len(logs)),
        ["find logs -name '*.log' | wc -l", "find logs -name '*.log' -exec mv {} archive/ \\;"],
        "count the .log files under logs/, then move them into archive/",
    )


def count_errors(tree: dict[str, str], nested: bool) -> Step:
    lines = [line for p in _files(tree, "logs", ".log") for line in tree[p].splitlines()]
    return Step(
        f"Print the number of lines containing ERROR across the .log files "
        f"{_where('logs', nested)}.",
        dict(tree),
        str(sum("ERROR" in line for line in lines)),
        ["find logs -name '*.log' -exec cat {} + | grep -c ERROR"],
        "concatenate the .log files under logs/ and count the lines with grep -c ERROR",
    )


def rename_txt(tree: dict[str, str], nested: bool) -> Step:
    after = {
        (p[: -len(".txt")] + ".md" if p.startswith("data/") and p.endswith(".txt") else p): t
        for p, t in tree.items()
    }
    return Step(
        f"Rename every .txt file {_where('data', nested)} so that it ends in .md instead "
        "(same name and directory otherwise).",
        after,
        None,
        ['find data -name \'*.txt\' | while read -r f; do mv "$f" "${f%.txt}.md"; done'],
        "loop over the .txt files under data/ and mv each to the .md name",
    )


def delete_empty(tree: dict[str, str], nested: bool) -> Step:
    after = {p: t for p, t in tree.items() if not (p.startswith("src/") and t == "")}
    return Step(
        f"Delete every empty file {_where('src', nested)}.",
        after,
        None,
        ["find src -type f -empty -delete"],
        "find the empty regular files under src/ and delete them",
    )


def csv_report(tree: dict[str, str], nested: bool) -> Step:
    names = sorted(_basename(p) for p in _files(tree, "data", ".csv"))
    return Step(
        f"Create report.txt in the working directory listing the file names (without "
        f"directories) of the .csv files {_where('data', nested)}, sorted, one per line.",
        {**tree, "report.txt": "".join(f"{n}\n" for n in names)},
        None,
        ["find data -name '*.csv' -printf '%f\\n' | LC_ALL=C sort > report.txt"],
        "list the .csv names under data/ with find -printf '%f', sort them into report.txt",
    )


def total_size(tree: dict[str, str], nested: bool) -> Step:
    size = sum(len(tree[p].encode()) for p in _files(tree, "data"))
    return Step(
        f"Print the total size in bytes of all the files {_where('data', nested)}.",
        dict(tree),
        str(size),
        ["find data -type f -exec cat {} + | wc -c"],
        "concatenate every file under data/ and count the bytes with wc -c",
    )


# Each template with the directories it reads or writes; a two-task episode uses disjoint ones.
TEMPLATES: dict[str, tuple[Callable[[dict[str, str], bool], Step], frozenset[str]]] = {
    "move_logs": (move_logs, frozenset({"logs", "archive"})),
    "count_errors": (count_errors, frozenset({"logs"})),
    "rename_txt": (rename_txt, frozenset({"data"})),
    "delete_empty": (delete_empty, frozenset({"src"})),
    "csv_report": (csv_report, frozenset({"data", "report.txt"})),
    "total_size": (total_size, frozenset({"data"})),
}


def _log_text(rng: random.Random, force_error: bool) -> str:
    lines = []
    for i in range(rng.randint(3, 8)):
        level = "ERROR" if force_error and i == 0 else rng.choice(LEVEL_NAMES)
        lines.append(f"2024-05-{rng.randint(1, 28):02d} {level} {rng.choice(MESSAGES)}")
    rng.shuffle(lines)
    return "\n".join(lines) + "\n"


def _csv_text(rng: random.Random) -> str:
    rows = [f"{rng.randint(1, 999)},{rng.choice(WORDS)}" for _ in range(rng.randint(1, 5))]
    return "id,name\n" + "\n".join(rows) + "\n"


def make_tree(rng: random.Random, difficulty: int) -> dict[str, str]:
    """A tree with unique file names: at least one of each kind a template needs (an ERROR
    line, an empty .py, a .csv, a .txt in data/), so no task is vacuous."""
    (low, high), nested, _ = LEVELS[difficulty]
    used: set[str] = set()

    def name(ext: str) -> str:
        while True:  # word + two digits: names sort the same in the C and any other locale
            stem = f"{rng.choice(WORDS)}{rng.randint(10, 99)}"
            if stem not in used:
                used.add(stem)
                return f"{stem}.{ext}"

    def place(top: str) -> str:
        if nested and rng.random() < 0.5:
            return f"{top}/{rng.choice(SUBDIRS[top])}"
        return top

    tree: dict[str, str] = {}
    for i in range(rng.randint(low, high)):
        tree[f"{place('logs')}/{name('log')}"] = _log_text(rng, force_error=i == 0)
    tree[f"logs/{name('txt')}"] = "notes about the logs\n"
    for i in range(rng.randint(low, high)):
        empty = i == 0 or rng.random() < 0.3
        tree[f"{place('src')}/{name('py')}"] = "" if empty else f"def f():\n    return {i}\n"
    kinds = ["csv", "txt"] + [rng.choice(("csv", "txt", "json")) for _ in range(high)]
    for ext in kinds[: max(2, rng.randint(low, high))]:
        text = _csv_text(rng) if ext == "csv" else f"{rng.choice(WORDS)} {rng.randint(1, 99)}\n"
        tree[f"{place('data')}/{name(ext)}"] = text
    tree[f"archive/{name('bak')}"] = "old backup\n"
    return dict(sorted(tree.items()))


def _normalized(tree: dict[str, str]) -> dict[str, str]:
    return {p: t.rstrip("\n") for p, t in tree.items()}


def _tree_diff(got: dict[str, str], want: dict[str, str]) -> str:
    """What differs, a few paths per kind."""
    got, want = _normalized(got), _normalized(want)
    parts = []
    for label, paths in (
        ("missing", sorted(want.keys() - got.keys())),
        ("unexpected", sorted(got.keys() - want.keys())),
        ("wrong content", sorted(p for p in want.keys() & got.keys() if want[p] != got[p])),
    ):
        if paths:
            shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
            parts.append(f"{label}: {shown}")
    return "; ".join(parts)


def observation(result: SandboxResult) -> str:
    output = result.stdout + result.stderr
    if len(output) > OUTPUT_CHARS:
        output = output[:OUTPUT_CHARS] + f"\n[... {len(output) - OUTPUT_CHARS} more characters]"
    code = result.exit_code
    if result.status in STOPPED or code is None:
        code = f"none ({result.status}: {result.reason})"
    output = output.rstrip("\n")
    return f"Output:\n{output}\nExit code: {code}"


class TerminalEpisode(Episode):
    def __init__(self, task: Task) -> None:
        super().__init__(task)
        self.sandbox = Sandbox(task.data["tree"], LIMITS)
        self.steps = 0
        self.invalid_ops = 0
        self.finished = False
        self.outputs: list[str] = []

    def step(self, completion: str) -> bool:
        self.messages.append({"role": "assistant", "content": completion})
        self.steps += 1
        command, done, invalid = parse_command_turn(completion)
        if done:
            self.finished = True
        elif invalid:
            self.invalid_ops += 1
            reply = (
                f"Invalid turn: {invalid}. Answer with exactly one command in a ```bash block, "
                "or DONE when the task is complete."
            )
            self.messages.append({"role": "user", "content": reply})
        else:
            result = self.sandbox.run("bash", command)
            self.outputs.append(result.stdout)
            if result.status in STOPPED or result.exit_code in CANNOT_RUN:
                self.invalid_ops += 1
            self.messages.append({"role": "user", "content": observation(result)})
        self.done = self.finished or self.steps >= MAX_STEPS
        return self.done

    def verdict(self) -> Verdict:
        metrics = {
            "steps": float(self.steps),
            "invalid_ops": float(self.invalid_ops),
            "finished": float(self.finished),
        }
        problems = []
        diff = _tree_diff(self.sandbox.tree(), self.task.data["expected_tree"])
        if diff:
            problems.append(f"final tree differs ({diff})")
        for value in self.task.data["printed"]:
            pattern = re.compile(rf"(?<!\d){re.escape(value)}(?!\d)")
            if not any(pattern.search(out) for out in self.outputs):
                problems.append(f"{value} was never printed")
        if problems:
            return Verdict(0.0, "; ".join(problems), metrics)
        return Verdict(1.0, f"correct in {self.steps} steps", metrics)

    def close(self) -> None:
        self.sandbox.close()


class TerminalDomain(Domain):
    name = "terminal"

    def generate(self, seed: int, difficulty: int) -> Task:
        if not MIN_DIFFICULTY <= difficulty <= MAX_DIFFICULTY:
            raise ValueError(f"difficulty must be in {MIN_DIFFICULTY}..{MAX_DIFFICULTY}")
        rng = random.Random(f"terminal-{seed}-{difficulty}")
        _, nested, n_tasks = LEVELS[difficulty]
        tree = make_tree(rng, difficulty)
        names: list[str] = []
        while len(names) < n_tasks:
            pick = rng.choice(sorted(TEMPLATES))
            if all(not TEMPLATES[pick][1] & TEMPLATES[n][1] for n in names):
                names.append(pick)
        state, steps = tree, []
        for pick in names:
            steps.append(TEMPLATES[pick][0](state, nested))
            state = steps[-1].tree
        if len(steps) == 1:
            instruction = steps[0].instruction
        else:
            instruction = " ".join(f"{i + 1}) {s.instruction}" for i, s in enumerate(steps))
            instruction = f"Do both: {instruction}"
        prompt = (
            "You are in a Linux shell, in a working directory that holds logs/, src/, data/ "
            f"and archive/.\n\nTask: {instruction}\n\n{PROTOCOL}"
        )
        data = {
            "templates": names,
            "tree": tree,
            "expected_tree": state,
            "printed": [s.printed for s in steps if s.printed is not None],
            "commands": [c for s in steps for c in s.commands],
            "plan": [s.plan for s in steps],
        }
        return Task("terminal", seed, difficulty, prompt, data)

    def reference(self, task: Task, style: Style) -> list[str]:
        turns = [f"```bash\n{c}\n```" for c in task.data["commands"]]
        if style == "think":
            plan = "\n".join(f"{i + 1}. {p}" for i, p in enumerate(task.data["plan"]))
            turns[0] = reasoning_block(f"Plan:\n{plan}") + turns[0]
        return [*turns, "DONE"]

    def start(self, task: Task) -> Episode:
        return TerminalEpisode(task)
