"""Function calling against generated tool schemas in the OpenAI `tools` format.

Each task offers 2-4 tools from a bank of plausible functions and asks for something that
exactly one call (or one chain of calls) satisfies, so the verifier can compare the call the
model makes with the expected one: same tool name, same arguments as parsed JSON (numbers
compared numerically, an optional argument may be left out when the expected value is its
default).

Difficulty:
    1: one call; the request states every argument as the schema wants it; one distractor.
    2: one call among 2-3 distractors; optional arguments, enums and numbers to normalise
       ("in Fahrenheit" -> "fahrenheit", "1,250.50 euros" -> 1250.5, "half an hour" -> 30).
    3: two calls in turn: tool A's result (a role "tool" message) holds a value that tool B
       needs, then a final answer in words that must mention a key value from B's result.

Reward: the fraction of checks passed, a check being each expected call (the whole turn must
be exactly that call) and, at difficulty 3, the final answer. An episode stops at the first
failed check: the conversation no longer matches the generated tool results.
"""

import copy
import json
import math
import random
import re
from typing import Any

from tasks import tool_tasks
from tasks.answers import (
    CALL_START,
    THINK_END,
    THINK_START,
    ToolCall,
    parse_tool_calls,
    split_reasoning,
    tool_call_block,
)
from tasks.base import (
    MAX_DIFFICULTY,
    MIN_DIFFICULTY,
    Domain,
    Episode,
    Style,
    Task,
    Verdict,
)
from tasks.tool_bank import BANK
from tasks.tool_tasks import CHAINS, NUMBER_WORDS, SINGLES, date_in_words


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value)


def _same(got: Any, want: Any) -> bool:
    """JSON equality with numbers compared by value (2 == 2.0) but booleans kept apart."""
    if isinstance(got, bool) or isinstance(want, bool):
        return type(got) is type(want) and got == want
    if isinstance(got, int | float) and isinstance(want, int | float):
        return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
    return type(got) is type(want) and got == want


def compare_arguments(tool: dict, expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """What is wrong with `got` as the arguments of `tool`, one message per argument. An
    argument the request did not set must be left out or given its default."""
    properties = tool["function"]["parameters"]["properties"]
    errors = [f"unexpected argument {name}" for name in got if name not in properties]
    for name, spec in properties.items():
        requested = name in expected
        want = expected[name] if requested else spec.get("default")
        if name not in got:
            if requested and not ("default" in spec and _same(spec["default"], want)):
                errors.append(f"missing argument {name}")
        elif not _same(got[name], want):
            note = "" if requested else " (the default)"
            errors.append(f"argument {name}: got {_show(got[name])}, expected {_show(want)}{note}")
    return errors


def check_call(
    expected: dict[str, Any],
    calls: list[ToolCall],
    content: str,
    reasoning: str | None,
    offered: dict[str, dict],
) -> str | None:
    """Why the turn is not exactly the expected call, or None when it is; arguments are
    checked against the schema the request offered (the bank's, or any other)."""
    if not calls:
        if CALL_START in content:
            return "malformed tool call: a <tool_call> block is not valid JSON with a name"
        if reasoning and CALL_START in reasoning:
            return "no tool call (the one inside <think> does not count)"
        return "no tool call"
    call = calls[0]
    if call.name != expected["name"]:
        return f"wrong tool {call.name}, expected {expected['name']}"
    try:
        got = json.loads(call.arguments)
    except json.JSONDecodeError:
        return "malformed JSON arguments"
    if not isinstance(got, dict):
        return "malformed JSON arguments: not an object"
    errors = compare_arguments(offered[call.name], expected["arguments"], got)
    if len(calls) > 1:
        errors.append(f"extra tool call {calls[1].name}")
    return "; ".join(errors) or None


class ToolsEpisode(Episode):
    """Checks each assistant turn against the next expected call (answering a correct call
    with its generated result in multi-turn tasks), then the final answer if there is one."""

    def __init__(self, task: Task, system: str | None = None) -> None:
        super().__init__(task, system)
        self.calls: list[dict[str, Any]] = task.data["calls"]
        self.offered = {tool["function"]["name"]: tool for tool in task.tools or []}
        self.key: str | None = task.data["key"]
        self.checks = len(self.calls) + (self.key is not None)
        self.passed, self.steps = 0, 0
        self.failure: str | None = None

    def step(self, completion: str) -> bool:
        self.steps += 1
        reasoning, content = split_reasoning(completion)
        text, calls = parse_tool_calls(content)
        for i, call in enumerate(calls):  # ids from the turn number: episodes stay reproducible
            call.id = f"call_{self.steps}_{i}"
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        self.messages.append(message)
        if self.passed < len(self.calls):
            expected = self.calls[self.passed]
            self.failure = check_call(expected, calls, content, reasoning, self.offered)
            if self.failure is None:
                self.passed += 1
                if expected["result"] is not None:
                    result = json.dumps(expected["result"], ensure_ascii=False)
                    self.messages.append(
                        {"role": "tool", "tool_call_id": calls[0].id, "content": result}
                    )
        elif calls:
            self.failure = f"unexpected tool call {calls[0].name}, expected a final answer"
        elif self.key not in text:
            self.failure = f"the answer does not mention {self.key!r}"
        else:
            self.passed += 1
        self.done = self.failure is not None or self.passed == self.checks
        return self.done

    def verdict(self) -> Verdict:
        if self.failure is not None:
            reason = self.failure
        elif self.passed == self.checks:
            reason = "correct"
        elif self.passed < len(self.calls):
            reason = f"ended before the call to {self.calls[self.passed]['name']}"
        else:
            reason = "ended before the final answer"
        return Verdict(self.passed / self.checks, reason, {"steps": float(self.steps)})


def _call_block(call: dict[str, Any]) -> str:
    body = json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
    return tool_call_block(body)


def _key_pair(data: dict[str, Any]) -> str:
    """The answer's field as the last result writes it (`"confirmation": "J394XR"`), so the
    code is copied with the same tokens before it as at its source, not after a space that
    tokenizes its first characters differently. Measured, it did not fix what it was meant
    to: demo-full miscopied 9 of 20 held-out codes before ("J394XR" as "J394,", "GPZS7R" as
    "GNQS7R") and 10 of 20 after 400 SFT steps with it, mid-code, at rare merged tokens."""
    result = data["calls"][-1]["result"]
    field = next(k for k, v in result.items() if v == data["key"])
    return json.dumps({field: data["key"]}, ensure_ascii=False)[1:-1]


def _value(key: str, value: Any, request: str) -> tuple[str, int]:
    """An argument as the note states it, and where the request gives it (its length if it
    does not). A date or a count the request gives in words is converted on the line, month
    number first, so the model recalls one fact and then copies ("three people" was
    passengers 2 in 2 of the 4 tasks demo-full failed at difficulty 2)."""
    text = json.dumps(value, ensure_ascii=False)
    iso = re.fullmatch(r"\d{4}-(\d\d)-(\d\d)", value) if isinstance(value, str) else None
    if iso and value not in request:
        month, day, words = *(int(part) for part in iso.groups()), date_in_words(value)
        return f'{key} "{words}" = month {month}, day {day} = {text}', _find(words, request)
    if type(value) is int and 0 <= value < len(NUMBER_WORDS):
        word = NUMBER_WORDS[value]
        in_words = re.search(rf"\b{word}\b", request, re.IGNORECASE)
        if in_words and not re.search(rf"(?<![\d-]){text}(?!\d)", request):
            return f'{key} "{in_words[0]}" = {text}', in_words.start()
    return f"{key} {text}", _find(str(value).replace("_", " "), request)


def _find(source: str, request: str) -> int:
    at = request.lower().find(source.lower())
    return len(request) if at < 0 else at


def call_note(tool: dict, arguments: dict[str, Any], request: str) -> str:
    """The brief reasoning of a single-call reference turn: the tool, what it does in its
    schema's words, and each argument in the order the request gives them, so the copying
    moves forward through the request. Meant for demo-full writing passengers "four" for
    "three people" and cabin "business" for "first class", which the request gives first;
    measured, it did not fix that (the model writes the new order with the same wrong values)."""
    name, description = tool["function"]["name"], tool["function"]["description"].rstrip(".")
    stated = [_value(key, value, request) for key, value in arguments.items()]
    values = ", ".join(note for note, _ in sorted(stated, key=lambda item: item[1]))
    return f"This needs {name} ({description[0].lower() + description[1:]}), with {values}."


class ToolsDomain(Domain):
    name = "tools"

    def generate(self, seed: int, difficulty: int) -> Task:
        if not MIN_DIFFICULTY <= difficulty <= MAX_DIFFICULTY:
            raise ValueError(f"difficulty must be in {MIN_DIFFICULTY}..{MAX_DIFFICULTY}")
        rng = random.Random(f"tools:{seed}:{difficulty}")
        if difficulty < 3:
            name = rng.choice(sorted(SINGLES))
            request, arguments = SINGLES[name](rng, difficulty == 2)
            note = call_note(BANK[name], arguments, request)
            calls = [tool_tasks.call(name, arguments, None, note)]
            data: dict[str, Any] = {"calls": calls, "key": None, "answer": None}
            n_distractors = 1 if difficulty == 1 else rng.randint(2, 3)
        else:
            chain = rng.choice(CHAINS)(rng)
            request = chain.pop("request")
            data = chain
            n_distractors = rng.randint(1, 2)
        used = [call["name"] for call in data["calls"]]
        names = used + rng.sample([n for n in sorted(SINGLES) if n not in used], n_distractors)
        rng.shuffle(names)
        tools = [copy.deepcopy(BANK[name]) for name in names]
        return Task(self.name, seed, difficulty, request, data, tools)

    def reference(self, task: Task, style: Style) -> list[str]:
        turns = []
        for call in task.data["calls"]:
            block = _call_block(call)
            turns.append(
                f"{THINK_START}\n{call['note']}\n{THINK_END}\n\n{block}"
                if style == "think"
                else block
            )
        if task.data["key"] is not None:
            answer = task.data["answer"]
            if style == "think":
                note = f"The last result has what the user asked for: {_key_pair(task.data)}."
                answer = f"{THINK_START}\n{note}\n{THINK_END}\n\n{answer}"
            turns.append(answer)
        return turns

    def start(self, task: Task) -> Episode:
        return ToolsEpisode(task)
