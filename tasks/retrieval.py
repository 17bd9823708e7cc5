"""Long-context retrieval: find one request's status in a long service log.

The prompt is a generated service log, one request per line, and a question about one request
(the needle), placed at a chosen depth of the log: 0 is its first line, 1 its last. Every line
has its own request id and a status drawn from the same codes as the needle's, so the answer
cannot be guessed from the question or from what is common in the log (chance is one in
`len(STATUSES)`): it has to be read off the needle's line. The verifier checks the answer
exactly: the status code, and nothing else, after any reasoning.

Length is counted in log lines, so a task is the same whatever the tokenizer; how many tokens
that makes is measured where a model reads it (`training/reports/retrieval.py`). `generate`
picks the length by difficulty and the depth from the seed; `generate_at` takes both, for a
table of accuracy by length and depth.
"""

import random
from dataclasses import dataclass

from tasks.answers import reasoning_block, split_reasoning
from tasks.base import (
    MAX_DIFFICULTY,
    MIN_DIFFICULTY,
    Domain,
    Episode,
    SingleAnswerEpisode,
    Style,
    Task,
    Verdict,
)

STATUSES = (200, 201, 204, 301, 302, 304, 400, 401, 403, 404, 409, 429, 500, 502, 503, 504)
SERVICES = ("auth", "billing", "search", "cart", "media", "users", "orders", "mail")
METHODS = ("GET", "POST", "PUT", "DELETE")
PATHS = ("/login", "/items", "/pay", "/profile", "/upload", "/query", "/orders", "/health")
LINES_BY_DIFFICULTY = {1: 16, 2: 48, 3: 128}
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DRILL_LOOKUPS = 32
QUESTION = (
    "In the log above, what status did request {request} get? Answer with the status code only."
)


@dataclass(frozen=True)
class LogEntry:
    request: str  # 4 hex digits, distinct within a log
    status: int
    line: str


def service_log(rng: random.Random, lines: int) -> list[LogEntry]:
    """`lines` requests a second or so apart, each with its own id and a random status."""
    ids = rng.sample(range(16**4), lines)  # distinct ids: one line answers a question
    second = rng.randrange(86_400)
    statuses = [rng.choice(STATUSES) for _ in ids]
    log = []
    for request_id, status in zip(ids, statuses, strict=True):
        second += rng.randint(0, 3)
        clock = f"{second // 3600 % 24:02d}:{second // 60 % 60:02d}:{second % 60:02d}"
        service, method, path = rng.choice(SERVICES), rng.choice(METHODS), rng.choice(PATHS)
        request = f"{request_id:04x}"
        line = f"{clock} {service} {method} {path} request {request} status={status}"
        log.append(LogEntry(request, status, f"{line} {rng.randint(1, 999)}ms"))
    return log


def log_text(log: list[LogEntry]) -> str:
    return "Service log:\n" + "\n".join(e.line for e in log)


def needle_index(lines: int, depth: float) -> int:
    """The needle's line at `depth` of a log of `lines` lines."""
    return round(depth * (lines - 1))


class RetrievalDomain(Domain):
    name = "retrieval"

    def generate(self, seed: int, difficulty: int) -> Task:
        if not MIN_DIFFICULTY <= difficulty <= MAX_DIFFICULTY:
            raise ValueError(f"difficulty must be in {MIN_DIFFICULTY}..{MAX_DIFFICULTY}")
        depth = random.Random(f"retrieval-depth:{seed}:{difficulty}").choice(DEPTHS)
        return self.generate_at(seed, LINES_BY_DIFFICULTY[difficulty], depth, difficulty)

    def generate_at(self, seed: int, lines: int, depth: float, difficulty: int = 0) -> Task:
        """The task of `seed` with a log of `lines` lines and the needle at `depth` (0..1);
        `difficulty` is only recorded (an evaluation by length and depth has none)."""
        if lines < 1 or not 0.0 <= depth <= 1.0:
            raise ValueError(f"need at least one line and a depth in [0, 1], got {lines}, {depth}")
        log = service_log(random.Random(f"retrieval:{seed}:{lines}:{depth}"), lines)
        needle = log[needle_index(lines, depth)]
        prompt = log_text(log) + "\n\n" + QUESTION.format(request=needle.request)
        data = {"lines": lines, "depth": depth, "request": needle.request}
        data |= {"answer": needle.status, "line": needle.line}
        return Task(self.name, seed, difficulty, prompt, data)

    def drill(self, seed: int, difficulty: int) -> str:
        """A log of up to the difficulty's length, then look-ups of its requests, each written
        as the log writes it: `request ID status=CODE`. Every code after a looked-up id is found
        by matching the id to its line (or to an earlier look-up of it), so most of a drill's
        predictable tokens are retrievals, where a solved task's text has one among hundreds of
        random ones; short logs and many look-ups make them denser still."""
        rng = random.Random(f"retrieval-drill:{seed}:{difficulty}")
        log = service_log(rng, rng.randint(2, LINES_BY_DIFFICULTY[difficulty]))
        asked = rng.choices(log, k=DRILL_LOOKUPS)
        lookups = [f"request {e.request} status={e.status}" for e in asked]
        return log_text(log) + "\n\nLookups:\n" + "\n".join(lookups)

    def reference(self, task: Task, style: Style) -> list[str]:
        answer = str(task.data["answer"])
        if style == "think":  # the evidence, id first: what follows the id in the log
            found = f"The log has: request {task.data['request']} status={answer}"
            return [reasoning_block(found) + answer]
        return [answer]

    def start(self, task: Task) -> Episode:
        return RetrievalEpisode(task)


def score(task: Task, completion: str) -> Verdict:
    """Full marks when the answer after any reasoning is exactly the needle's status code."""
    _, content = split_reasoning(completion)
    got, expected = content.strip(), str(task.data["answer"])
    if not got:
        return Verdict(0.0, "empty")
    if got != expected:
        return Verdict(0.0, f"wrong: got {got[:40]!r}, expected {expected}")
    return Verdict(1.0, "correct")


class RetrievalEpisode(SingleAnswerEpisode):
    def score(self, completion: str) -> Verdict:
        return score(self.task, completion)
