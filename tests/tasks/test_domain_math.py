"""The math domain: seeded expressions, a trace whose every line is true, a strict verifier."""

import re

import pytest

from serving.model.tokenizer import Tokenizer
from tasks.answers import split_reasoning
from tasks.base import play
from tasks.math import (
    LEVELS,
    TRACE_LINES,
    MathDomain,
    count_ops,
    evaluate,
    operands,
    render,
)

DOMAIN = MathDomain()
SEEDS = range(150)
LABEL = re.compile(r"^[\w^-]+: ")
ARITHMETIC = re.compile(r"[\d+\-*() ]+")
BORROW = re.compile(r"^\d(-\d)+<0, ")


def _products_have_small_factor(tree, factor_digits: int) -> bool:
    if isinstance(tree, int):
        return True
    op, left, right = tree
    if op == "*" and not any(
        isinstance(t, int) and len(str(t)) <= factor_digits for t in (left, right)
    ):
        return False
    return _products_have_small_factor(left, factor_digits) and _products_have_small_factor(
        right, factor_digits
    )


def test_same_seed_same_task_and_seeds_differ() -> None:
    for difficulty in (1, 2, 3):
        assert DOMAIN.generate(7, difficulty) == DOMAIN.generate(7, difficulty)
        prompts = {DOMAIN.generate(seed, difficulty).prompt for seed in range(50)}
        assert len(prompts) > 40


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_difficulty_bounds_operations_and_digits(difficulty: int) -> None:
    min_ops, max_ops, max_digits, factor_digits = LEVELS[difficulty]
    seen_ops = set()
    for seed in SEEDS:
        task = DOMAIN.generate(seed, difficulty)
        tree = task.data["tree"]
        seen_ops.add(count_ops(tree))
        assert all(1 <= len(str(n)) <= max_digits for n in operands(tree))
        assert _products_have_small_factor(tree, factor_digits)
        assert render(tree) == task.data["expression"] and task.data["expression"] in task.prompt
        assert eval(task.data["expression"]) == evaluate(tree) == task.data["answer"]
        assert " x " not in task.prompt
    assert seen_ops == set(range(min_ops, max_ops + 1))


def test_bad_difficulty_is_refused() -> None:
    with pytest.raises(ValueError):
        DOMAIN.generate(0, 4)


@pytest.mark.parametrize("style", ["think", "short"])
@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_references_score_full_marks(style: str, difficulty: int) -> None:
    for seed in SEEDS:
        task = DOMAIN.generate(seed, difficulty)
        episode, verdict = play(DOMAIN, task, DOMAIN.reference(task, style))
        assert (verdict.reward, verdict.reason) == (1.0, "correct"), task.prompt
        assert episode.done and episode.messages[-1]["content"] == str(task.data["answer"])


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_every_trace_line_is_true_arithmetic(difficulty: int) -> None:
    for seed in SEEDS:
        task = DOMAIN.generate(seed, difficulty)
        reasoning, content = split_reasoning(DOMAIN.reference(task, "think")[0])
        assert content == str(task.data["answer"])
        checked = 0
        for line in reasoning.splitlines():
            line = LABEL.sub("", line.strip().removeprefix("So "))
            if "=" not in line:
                continue
            if BORROW.match(line):  # "3-1-5<0, 10+3-1-5=7": the claim is true
                claim, line = line.split(", ", 1)
                assert eval(claim.removesuffix("<0")) < 0, line
            equation, *notes = line.rstrip(".").split(", ")
            parts = re.split(r" ?= ?", equation)
            assert len(parts) >= 2 and all(ARITHMETIC.fullmatch(p) for p in parts), line
            values = {eval(p) for p in parts}
            assert len(values) == 1, line
            for note in notes:  # "write 3 carry 1" must agree with the column's sum
                digit = int(note.split()[1]) if note.startswith("write") else None
                assert digit is None or digit == values.pop() % 10, line
            checked += 1
        assert checked >= count_ops(task.data["tree"]) + 1
        assert (
            reasoning.splitlines()[-1] == f"So {task.data['expression']} = {task.data['answer']}."
        )


def test_long_operations_are_worked_digit_by_digit() -> None:
    task = next(t for t in (DOMAIN.generate(s, 3) for s in SEEDS) if "*" in t.data["expression"])
    trace = DOMAIN.reference(task, "think")[0]
    assert "by partial products:" in trace and "in columns:" in trace
    assert "ones: " in trace


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_no_trace_line_does_multi_digit_arithmetic_at_once(difficulty: int) -> None:
    """Every column line combines single digits (plus a carry or a borrowed ten); the lines
    that state a multi-digit operation's result only collect the columns above them."""
    column = re.compile(r"(10\+)?\d([+*-]\d)*([+-]\d)?=\d+")
    for seed in SEEDS:
        task = DOMAIN.generate(seed, difficulty)
        reasoning, _ = split_reasoning(DOMAIN.reference(task, "think")[0])
        lines = reasoning.splitlines()
        for i, line in enumerate(lines):
            match = re.fullmatch(r"\(?(-?\d+)\)? ([+*-]) \(?(-?\d+)\)? = -?\d+", line)
            sizes = sorted(abs(int(match[k])) for k in (1, 3)) if match else [0, 0]
            if sizes[0] > 1 and sizes[1] >= 10:
                assert lines[i - 1].startswith("  "), line  # its working comes first
            body = LABEL.sub("", line.strip())
            if line.startswith("  ") and LABEL.match(line.strip()) and "copy down" not in line:
                assert column.fullmatch(BORROW.sub("", body).split(", ")[0]), line


@pytest.mark.parametrize(
    ("completion", "reward", "reason"),
    [
        ("3114", 1.0, "correct"),
        ("The answer is 3,114.", 1.0, "correct"),
        ("519 x 6 = 3 114", 1.0, "correct"),
        ("<think>\n482 + 37 = 519\n519 * 6 = 3114\n</think>\n\n**3114**", 1.0, "correct"),
        ("482 + 37 = 519, 519 * 6 = 3114, so 3115", 0.0, "wrong: got 3115, expected 3114"),
        ("<think>\nit is 3114\n</think>\n\nI am not sure.", 0.0, "no integer in the answer"),
        ("<think>\nit is 3114\n</think>\n\n", 0.0, "empty"),
        ("<think>\nit is 3114, or maybe", 0.0, "empty"),
        ("", 0.0, "empty"),
        ("-3114", 0.0, "wrong: got -3114, expected 3114"),
        ("3114.5", 0.0, "wrong: got 5, expected 3114"),
    ],
)
def test_verifier(completion: str, reward: float, reason: str) -> None:
    task = DOMAIN.generate(0, 1)
    task = type(task)(task.domain, 0, 1, "Compute (482 + 37) * 6.", {**task.data, "answer": 3114})
    _, verdict = play(DOMAIN, task, [completion])
    assert (verdict.reward, verdict.reason) == (reward, reason)


def test_negative_answers_and_unfinished_episodes() -> None:
    task = next(t for t in (DOMAIN.generate(s, 2) for s in SEEDS) if t.data["answer"] < -999)
    answer = task.data["answer"]
    assert play(DOMAIN, task, [f"It comes to {answer:,}."])[1].reward == 1.0
    assert play(DOMAIN, task, [f"It comes to {-answer:,}."])[1].reward == 0.0
    assert play(DOMAIN, task, [])[1].reason == "no answer"


def test_echoing_the_question_never_scores() -> None:
    for difficulty in (1, 2, 3):
        for seed in SEEDS:
            task = DOMAIN.generate(seed, difficulty)
            assert play(DOMAIN, task, [task.prompt])[1].reward == 0.0
            assert play(DOMAIN, task, [task.data["expression"]])[1].reward == 0.0


def test_reference_conversations_render_through_the_chat_template(random_checkpoint) -> None:
    tokenizer = Tokenizer.from_dir(random_checkpoint)
    for difficulty in (1, 2, 3):
        task = DOMAIN.generate(difficulty, difficulty)
        for style in ("think", "short"):
            episode, _ = play(DOMAIN, task, DOMAIN.reference(task, style))
            text = tokenizer.apply_chat_template(
                episode.messages, tools=task.tools, add_generation_prompt=False
            )
            assert task.prompt in text and text.endswith(f"{task.data['answer']}<|im_end|>\n")
            assert "<think>\nWork out " in text  # both styles keep the working
            assert (f"So {task.data['expression']} =" in text) == (style == "think")
            assert tokenizer.encode(text)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_trace_says_what_is_left_and_fits_the_answer_budget(difficulty: int) -> None:
    """After every operation the trace rewrites what is left, ending on the bare answer, so
    the model reads when to stop; the working stays within the line budget."""
    for seed in SEEDS:
        task = DOMAIN.generate(seed, difficulty)
        reasoning, _ = split_reasoning(DOMAIN.reference(task, "think")[0])
        left = [
            line.removeprefix("Left: ")
            for line in reasoning.splitlines()
            if line.startswith("Left: ")
        ]
        assert len(left) == count_ops(task.data["tree"])
        assert left[-1] == str(task.data["answer"])
        assert all(eval(e) == task.data["answer"] for e in left)
        assert len(reasoning.splitlines()) <= TRACE_LINES + 3  # + what, products first, so


def test_single_digit_facts_are_written_as_columns() -> None:
    task = type(DOMAIN.generate(0, 1))("math", 0, 1, "What is 7 + 4?", {})
    task.data.update(expression="7 + 4", tree=["+", 7, 4], answer=11)
    reasoning, _ = split_reasoning(DOMAIN.reference(task, "think")[0])
    assert "  ones: 7+4=11\n7 + 4 = 11\nLeft: 11" in reasoning


def test_the_trace_brackets_products_and_names_what_to_copy_and_when_to_borrow() -> None:
    """The three places a small model went wrong: the next operation of `18 + 2 * 715` (it
    added first), the second partial product's digit, and the borrow decided before the
    digits were written."""
    tree = ["+", ["*", 3, 6], ["*", 2, 715]]
    task = type(DOMAIN.generate(0, 1))("math", 0, 2, "x", {})
    task.data.update(expression=render(tree), tree=tree, answer=evaluate(tree))
    reasoning, _ = split_reasoning(DOMAIN.reference(task, "think")[0])
    assert "\nProducts first: (3 * 6) + (2 * 715)\n" in reasoning
    assert "\nLeft: 18 + (2 * 715)\n" in reasoning
    tree = ["-", ["*", 200, 53], 2453]
    task.data.update(expression=render(tree), tree=tree, answer=evaluate(tree))
    reasoning, _ = split_reasoning(DOMAIN.reference(task, "think")[0])
    assert "  200 * 53 = 200 * 3 + 200 * 50, by partial products:\n  200 * 3 in" in reasoning
    assert "  ones: 0-3<0, 10+0-3=7\n" in reasoning
    assert "  tens: 0-1-5<0, 10+0-1-5=4\n" in reasoning
    assert "\nProducts first: (200 * 53) - 2453\n" in reasoning
    tree = ["-", 5431, ["-", 2454, 1]]
    task.data.update(expression=render(tree), tree=tree, answer=evaluate(tree))
    assert "Products first" not in DOMAIN.reference(task, "think")[0]  # nothing to bracket
