"""One answer extraction: the verifiers and the router's cascade read a reply the same way."""

import pytest

from router.cascade import validate_answer
from tasks import get_domain
from tasks.answers import (
    extract_program,
    final_integer,
    parse_command_turn,
    parse_tool_calls,
    split_reasoning,
)

PROGRAM = "def solve(n):\n    return n + 1\n"


@pytest.mark.parametrize(
    ("reply", "program"),
    [
        (f"```python\n{PROGRAM}```", PROGRAM),
        (f"```python3\n{PROGRAM}```", PROGRAM),  # passed the verifier, failed the cascade
        (f"```py\n{PROGRAM}```", PROGRAM),
        (f"```\n{PROGRAM}```", PROGRAM),
        (f"```python  \n{PROGRAM}```", PROGRAM),
        (f"Here:\n```python\nx = 1\n```\nBetter:\n```python\n{PROGRAM}```", PROGRAM),
        (f"<think>\n```python\nbroken(\n```\n</think>\n\n```python\n{PROGRAM}```", PROGRAM),
        (PROGRAM, PROGRAM),  # a reply that is only code is the program
        ("```javascript\nlet x = 1;\n```", "```javascript\nlet x = 1;\n```"),
    ],
)
def test_program_extraction(reply: str, program: str) -> None:
    assert extract_program(reply) == program


@pytest.mark.parametrize(
    ("reply", "turn"),
    [
        ("```bash\nls -la\n```", ("ls -la\n", False, None)),
        ("```sh\nls\n```", ("ls\n", False, None)),
        ("Listing first.\n```bash\nls\n```", ("ls\n", False, None)),
        ("DONE", (None, True, None)),
        ("  DONE  \n", (None, True, None)),
        ("<think>\n```bash\nrm x\n```\n</think>\n\nDONE", (None, True, None)),
        # the cascade accepted these; the terminal verifier never did
        ("```\nls\n```", (None, False, "no ```bash block and no DONE")),
        ("```shell\nls\n```", (None, False, "no ```bash block and no DONE")),
        ("All done.", (None, False, "no ```bash block and no DONE")),
        ("```bash\nls\n```\n```bash\npwd\n```", (None, False, "2 command blocks")),
        ("```bash\nls\n```\nDONE", (None, False, "both a command and DONE")),
        ("```bash\n\n```", (None, False, "an empty command")),
    ],
)
def test_command_turns(reply: str, turn: tuple) -> None:
    assert parse_command_turn(reply) == turn


@pytest.mark.parametrize(
    ("content", "value"),
    [
        ("391", 391),
        ("The answer is 1,234.", 1234),
        ("1 234 567", 1234567),
        ("\u221242", -42),
        ("3 * 4 = 12, so the answer is 12. Hope that helps!", 12),
        ("I cannot say.", None),
    ],
)
def test_final_integer(content: str, value: int | None) -> None:
    assert final_integer(content) == value


def test_reasoning_and_tool_calls() -> None:
    assert split_reasoning("<think>\nwhy\n</think>\n\n42") == ("why", "42")
    assert split_reasoning("why</think>42") == ("why", "42")  # opened in the prompt
    assert split_reasoning("<think>\ncut off") == ("cut off", "")
    content, calls = parse_tool_calls(
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )
    assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("f", '{"a": 1}')])
    assert parse_tool_calls("<tool_call>\n{broken\n</tool_call>")[1] == []


def _response(content: str) -> dict:
    message = {"role": "assistant", "content": content}
    return {"choices": [{"finish_reason": "stop", "message": message}]}


@pytest.mark.parametrize(
    ("prompt", "content", "failure"),
    [
        ("Write a Python function solve(n).", f"```python3\n{PROGRAM}```", None),
        ("Write a Python function solve(n).", "```python\ndef solve(:\n```", "no_valid_code"),
        ("Write a Python function solve(n).", "", "no_valid_code"),
        ("In the shell, list the files in the current directory.", "```sh\nls\n```", None),
        ("In the shell, list the files in the current directory.", "```\nls\n```", "no_command"),
        ("In the shell, list the files in the current directory.", "DONE", None),
        ("What is 17 * 23?", "It is 391. Anything else?", None),
        ("What is 17 * 23?", "I cannot say.", "no_final_number"),
    ],
)
def test_cascade_reads_as_the_verifiers(prompt: str, content: str, failure: str | None) -> None:
    body = {"messages": [{"role": "user", "content": prompt}]}
    assert validate_answer(body, _response(content)) == failure


@pytest.mark.parametrize("name", ["math", "code", "terminal"])
@pytest.mark.parametrize("style", ["think", "short"])
def test_the_cascade_passes_every_first_reference_turn(name: str, style: str) -> None:
    """A reference turn is what the verifier scores 1.0; the cascade, given it as the API
    returns it (reasoning split off), must not escalate it."""
    domain = get_domain(name)
    for seed in range(20):
        task = domain.generate(seed, 1 + seed % 3)
        _, content = split_reasoning(domain.reference(task, style)[0])
        body = {"messages": [{"role": "user", "content": task.prompt}]}
        assert validate_answer(body, _response(content)) is None, (task.prompt, content)
