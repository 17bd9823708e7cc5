"""The retrieval domain: a needle line at the asked depth of a log, one line per request id,
an exact verifier, look-up drills for pretraining; registered but outside the default domains."""

import re

import pytest

from tasks import DEFAULT_DOMAINS, DOMAINS, get_domain, opening_requests
from tasks.base import play
from tasks.retrieval import (
    DEPTHS,
    DRILL_LOOKUPS,
    LINES_BY_DIFFICULTY,
    STATUSES,
    RetrievalDomain,
    needle_index,
)
from training.config import DataConfig, EvalSpec
from training.data.datasets import pretrain_text

DOMAIN = RetrievalDomain()
LINE = re.compile(r"^\d\d:\d\d:\d\d \w+ [A-Z]+ /\w+ request ([0-9a-f]{4}) status=(\d{3}) \d+ms$")


def _log(prompt: str) -> list[str]:
    body = prompt.split("\n\n")[0].splitlines()
    assert body[0] == "Service log:"
    return body[1:]


@pytest.mark.parametrize("lines", [1, 7, 64])
@pytest.mark.parametrize("depth", DEPTHS)
def test_needle_at_its_depth_and_its_id_on_one_line(lines: int, depth: float) -> None:
    task = DOMAIN.generate_at(11, lines, depth)
    log = _log(task.prompt)
    assert len(log) == lines
    parsed = [LINE.match(line) for line in log]
    assert all(parsed), log
    ids = [m.group(1) for m in parsed]
    assert len(set(ids)) == lines  # the question has one answer
    at = needle_index(lines, depth)
    assert log[at] == task.data["line"]
    assert ids[at] == task.data["request"] and ids.count(task.data["request"]) == 1
    assert int(parsed[at].group(2)) == task.data["answer"]
    assert task.prompt.endswith(f"what status did request {task.data['request']} get? "
                                "Answer with the status code only.")  # fmt: skip


def test_depth_ends_are_first_and_last_line() -> None:
    assert needle_index(10, 0.0) == 0 and needle_index(10, 1.0) == 9
    assert needle_index(101, 0.5) == 50


def test_seeded_and_difficulty_sets_length() -> None:
    for difficulty, lines in LINES_BY_DIFFICULTY.items():
        task = DOMAIN.generate(5, difficulty)
        assert task == DOMAIN.generate(5, difficulty)
        assert task.data["lines"] == lines and task.data["depth"] in DEPTHS
    assert DOMAIN.generate(5, 1).prompt != DOMAIN.generate(6, 1).prompt
    depths = {DOMAIN.generate(seed, 2).data["depth"] for seed in range(40)}
    assert depths == set(DEPTHS)  # the seed spreads the needle over every depth


def test_statuses_vary_so_the_answer_must_be_read() -> None:
    answers = {DOMAIN.generate(seed, 1).data["answer"] for seed in range(200)}
    assert answers == set(STATUSES)
    log = _log(DOMAIN.generate_at(3, 128, 0.5).prompt)
    assert len({LINE.match(line).group(2) for line in log}) > len(STATUSES) // 2


@pytest.mark.parametrize("style", ["think", "short"])
def test_references_verify(style: str) -> None:
    for seed in range(30):
        for difficulty in LINES_BY_DIFFICULTY:
            task = DOMAIN.generate(seed, difficulty)
            _, verdict = play(DOMAIN, task, DOMAIN.reference(task, style))
            assert verdict.reward == 1.0, verdict


def test_verifier_is_exact() -> None:
    task = DOMAIN.generate_at(2, 16, 0.5)
    answer = str(task.data["answer"])
    wrong = next(str(s) for s in STATUSES if str(s) != answer)
    assert play(DOMAIN, task, [f"  {answer}\n"])[1].reward == 1.0
    assert play(DOMAIN, task, [f"<think>\nsaw {wrong}\n</think>\n\n{answer}"])[1].reward == 1.0
    for bad in (wrong, f"status={answer}", f"{answer} {answer}", f"The status is {answer}.", ""):
        assert play(DOMAIN, task, [bad])[1].reward == 0.0, bad
    assert play(DOMAIN, task, [])[1].reason == "no answer"


def test_bad_arguments_refused() -> None:
    with pytest.raises(ValueError):
        DOMAIN.generate(0, 4)
    with pytest.raises(ValueError):
        DOMAIN.generate_at(0, 0, 0.5)
    with pytest.raises(ValueError):
        DOMAIN.generate_at(0, 8, 1.5)


def test_registered_but_not_a_default() -> None:
    assert get_domain("retrieval") is DOMAINS["retrieval"]
    assert "retrieval" not in DEFAULT_DOMAINS and set(DEFAULT_DOMAINS) < set(DOMAINS)
    assert EvalSpec().domains == list(DEFAULT_DOMAINS)
    assert set(DataConfig().mix) == set(DEFAULT_DOMAINS)
    assert DataConfig(mix={"retrieval": 1.0}).mix == {"retrieval": 1.0}  # named, it is accepted
    kinds = {request["kind"].rsplit("-", 1)[0] for request in opening_requests(per_kind=1)}
    assert kinds == set(DEFAULT_DOMAINS)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_a_drill_looks_up_its_own_log(difficulty: int) -> None:
    """Every look-up names a request of the drill's log and gives that request's status, as the
    log writes it; the drill is seeded, and pretraining on the domain reads drills."""
    drill = DOMAIN.drill(5, difficulty)
    assert drill == DOMAIN.drill(5, difficulty) != DOMAIN.drill(6, difficulty)
    log_text, lookups_text = drill.split("\n\nLookups:\n")
    log = [LINE.match(line).groups() for line in _log(log_text)]
    assert 2 <= len(log) <= LINES_BY_DIFFICULTY[difficulty]
    status_of = dict(log)
    lookups = lookups_text.splitlines()
    assert len(lookups) == DRILL_LOOKUPS
    for lookup in lookups:
        request, status = re.fullmatch(r"request ([0-9a-f]{4}) status=(\d{3})", lookup).groups()
        assert status_of[request] == status
    data = DataConfig(examples=6, mix={"retrieval": 1.0}, difficulties=[difficulty], seed=5)
    assert all("\n\nLookups:\n" in doc for doc in pretrain_text(data))


def test_other_domains_pretrain_on_solved_tasks() -> None:
    assert all(get_domain(name).drill(0, 1) is None for name in DEFAULT_DOMAINS)
