"""The terminal domain: generated trees and tasks, the turn protocol, and the verifier
against wrong, malformed and adversarial command sequences (run for real in the sandbox)."""

import pytest

from tasks.base import MAX_DIFFICULTY, MIN_DIFFICULTY, play
from tasks.terminal import MAX_STEPS, OUTPUT_CHARS, TEMPLATES, TerminalDomain

DOMAIN = TerminalDomain()
SEEDS = range(3)


def task_with(template: str, difficulty: int = 1):
    """The first generated task that uses `template`."""
    for seed in range(200):
        task = DOMAIN.generate(seed, difficulty)
        if template in task.data["templates"]:
            return task
    raise AssertionError(f"no task uses {template}")


def bash(command: str) -> str:
    return f"```bash\n{command}\n```"


def test_generation_is_deterministic_and_scales_with_difficulty():
    assert len(TEMPLATES) >= 6
    for difficulty in range(MIN_DIFFICULTY, MAX_DIFFICULTY + 1):
        for seed in range(10):
            task = DOMAIN.generate(seed, difficulty)
            assert task == DOMAIN.generate(seed, difficulty)
            assert len(task.data["templates"]) == (2 if difficulty == 3 else 1)
            nested = any(p.count("/") > 1 for p in task.data["tree"])
            assert nested or difficulty == 1
            if difficulty == 1:
                assert not nested
    assert DOMAIN.generate(0, 1).data["tree"] != DOMAIN.generate(1, 1).data["tree"]
    sizes = [sum(len(DOMAIN.generate(s, d).data["tree"]) for s in range(10)) for d in (1, 2, 3)]
    assert sizes == sorted(sizes)
    with pytest.raises(ValueError):
        DOMAIN.generate(0, 0)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_every_template_reference_solves_it(template):
    task = task_with(template, difficulty=2)
    _, verdict = play(DOMAIN, task, DOMAIN.reference(task, "short"))
    assert verdict.reward == 1.0, verdict.reason
    assert verdict.metrics["invalid_ops"] == 0 and verdict.metrics["finished"] == 1.0


@pytest.mark.parametrize("style", ["short", "think"])
def test_references_score_one_at_every_difficulty(style):
    for difficulty in range(MIN_DIFFICULTY, MAX_DIFFICULTY + 1):
        for seed in SEEDS:
            task = DOMAIN.generate(seed, difficulty)
            turns = DOMAIN.reference(task, style)
            assert turns[-1] == "DONE" and turns[0].startswith("<think>") == (style == "think")
            _, verdict = play(DOMAIN, task, turns)
            assert verdict.reward == 1.0, (seed, difficulty, verdict.reason)
            assert verdict.metrics["steps"] == len(turns)


def test_observation_format_and_truncation():
    task = task_with("delete_empty")
    episode = DOMAIN.start(task)
    try:
        episode.step(bash("echo hi; echo oops >&2; exit 3"))
        assert episode.messages[-1] == {
            "role": "user",
            "content": "Output:\nhi\noops\nExit code: 3",
        }
        episode.step(bash(f"head -c {OUTPUT_CHARS + 500} /dev/zero | tr '\\0' x"))
        assert "[... 500 more characters]" in episode.messages[-1]["content"]
    finally:
        episode.close()


def test_done_immediately_fails_with_a_precise_reason():
    task = task_with("move_logs")
    _, verdict = play(DOMAIN, task, ["DONE"])
    assert verdict.reward == 0.0
    assert verdict.reason.startswith("final tree differs (missing: archive/")
    assert f"{task.data['printed'][0]} was never printed" in verdict.reason
    assert verdict.metrics == {"steps": 1.0, "invalid_ops": 0.0, "finished": 1.0}


def test_printing_the_number_without_doing_the_moves_fails():
    task = task_with("move_logs")
    count = task.data["printed"][0]
    _, verdict = play(DOMAIN, task, [bash(f"echo {count}"), "DONE"])
    assert verdict.reward == 0.0 and "final tree differs" in verdict.reason
    assert "never printed" not in verdict.reason


def test_moving_without_printing_fails():
    task = task_with("move_logs")
    turns = [bash(task.data["commands"][1]), "DONE"]
    _, verdict = play(DOMAIN, task, turns)
    assert verdict.reason == f"{task.data['printed'][0]} was never printed"


def test_invalid_turns_are_counted_and_answered():
    task = task_with("delete_empty")
    turns = [
        "I will delete them.",  # no block
        bash("ls") + bash("ls"),  # two blocks
        bash("ls") + "\nDONE",  # a command and DONE
        bash(""),  # an empty command
        bash("no-such-command"),  # the shell cannot run it
        bash("grep -c nothing-here src -r"),  # non-zero exit: ordinary feedback
        *DOMAIN.reference(task, "short"),
    ]
    episode, verdict = play(DOMAIN, task, turns)
    assert verdict.reward == 1.0
    assert verdict.metrics["invalid_ops"] == 5.0 and verdict.metrics["steps"] == len(turns)
    replies = [m["content"] for m in episode.messages if m["role"] == "user"][1:]
    assert replies[0].startswith("Invalid turn: no ```bash block and no DONE")
    assert replies[1].startswith("Invalid turn: 2 command blocks")
    assert replies[2].startswith("Invalid turn: both a command and DONE")
    assert replies[3].startswith("Invalid turn: an empty command")
    assert replies[4].endswith("Exit code: 127")
    assert replies[5].endswith("Exit code: 1")


def test_episode_stops_after_max_steps():
    task = task_with("count_errors")
    episode, verdict = play(DOMAIN, task, [bash("true")] * (MAX_STEPS + 5))
    assert episode.done and verdict.metrics["steps"] == MAX_STEPS
    assert verdict.metrics["finished"] == 0.0 and verdict.reward == 0.0


def test_commands_cannot_touch_files_outside_the_work_dir():
    task = task_with("delete_empty")
    episode = DOMAIN.start(task)
    outside = episode.sandbox.root.parent
    try:
        escape = "echo pwned > ../escape.txt; echo pwned > /tmp/escape.txt; rm -rf ../prog"
        episode.step(bash(escape))
        episode.step("DONE")
        verdict = episode.verdict()
        assert verdict.reward == 0.0 and "final tree differs" in verdict.reason
        if episode.sandbox.isolation != "rlimits":  # an opted-in fallback confines no writes
            assert not (outside / "escape.txt").exists()
            assert (outside / "prog").is_dir()
    finally:
        episode.close()
