"""The tools domain: generated schemas, one correct call (or chain), a precise verifier."""

import json
from dataclasses import replace

import pytest

from serving.model.tokenizer import Tokenizer
from tasks.answers import parse_tool_calls
from tasks.base import play
from tasks.tool_bank import BANK
from tasks.tool_tasks import SINGLES, running_best
from tasks.tools import ToolsDomain

DOMAIN = ToolsDomain()
SEEDS = range(150)


def _block(name: str, arguments: dict | str) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def _task(difficulty: int, predicate=lambda task: True):
    return next(t for t in (DOMAIN.generate(s, difficulty) for s in SEEDS) if predicate(t))


def test_same_seed_same_task() -> None:
    for difficulty in (1, 2, 3):
        assert DOMAIN.generate(3, difficulty) == DOMAIN.generate(3, difficulty)
        assert len({DOMAIN.generate(s, difficulty).prompt for s in range(50)}) > 35


def test_bank_has_typed_schemas() -> None:
    assert len(BANK) >= 12
    types, enums, optional = set(), 0, 0
    for name, tool in BANK.items():
        assert tool["type"] == "function" and tool["function"]["name"] == name
        schema = tool["function"]["parameters"]
        assert schema["type"] == "object" and set(schema["required"]) <= set(schema["properties"])
        for param, spec in schema["properties"].items():
            types.add(spec["type"])
            enums += "enum" in spec
            if param not in schema["required"]:
                optional += 1
                assert "default" in spec, (name, param)
    assert types == {"string", "integer", "number", "boolean"}
    assert enums >= 5 and optional >= 8


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_difficulty_shapes_the_task(difficulty: int) -> None:
    for seed in SEEDS:
        task = DOMAIN.generate(seed, difficulty)
        names = [tool["function"]["name"] for tool in task.tools]
        calls = task.data["calls"]
        assert len(set(names)) == len(names) and all(call["name"] in names for call in calls)
        if difficulty == 1:
            assert len(names) == 2 and len(calls) == 1 and task.data["key"] is None
            assert all(str(v) in task.prompt for v in calls[0]["arguments"].values())
        elif difficulty == 2:
            assert 3 <= len(names) <= 4 and len(calls) == 1 and task.data["key"] is None
        else:
            assert 3 <= len(names) <= 4 and len(calls) == 2 and task.data["key"]
            first, second = calls
            # The second call needs a value that only the first call's result holds.
            result_text = json.dumps(first["result"])
            assert any(
                str(v) in result_text and str(v) not in task.prompt
                for v in second["arguments"].values()
            )
            assert task.data["key"] in json.dumps(second["result"])
            assert task.data["key"] not in task.prompt


def test_hard_requests_need_normalising() -> None:
    """At difficulty 2 most requests do not spell the arguments as the schema wants them."""
    literal = 0
    for seed in SEEDS:
        task = DOMAIN.generate(seed, 2)
        literal += all(
            json.dumps(v).strip('"') in task.prompt
            for v in task.data["calls"][0]["arguments"].values()
        )
    assert literal < len(SEEDS) / 3
    assert set(SINGLES) <= set(BANK)


@pytest.mark.parametrize("style", ["think", "short"])
@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_references_score_full_marks(style: str, difficulty: int) -> None:
    for seed in SEEDS:
        task = DOMAIN.generate(seed, difficulty)
        turns = DOMAIN.reference(task, style)
        assert all(("<think>" in turn) == (style == "think") for turn in turns)
        episode, verdict = play(DOMAIN, task, turns)
        assert (verdict.reward, verdict.reason) == (1.0, "correct"), task.prompt
        assert verdict.metrics["steps"] == len(turns)
        calls = [
            c for m in episode.messages if m["role"] == "assistant" for c in m.get("tool_calls", [])
        ]
        assert [c["function"]["name"] for c in calls] == [c["name"] for c in task.data["calls"]]
        results = [m for m in episode.messages if m["role"] == "tool"]
        if difficulty == 3:
            assert [m["tool_call_id"] for m in results] == [c["id"] for c in calls]
            assert json.loads(results[0]["content"]) == task.data["calls"][0]["result"]
            assert task.data["key"] in episode.messages[-1]["content"]
        else:
            assert results == [] and episode.messages[-1]["tool_calls"]


def _weather_paris():
    """A difficulty-1 task whose one expected call is get_weather(city="Paris")."""
    task = _task(1, lambda t: t.data["calls"][0]["name"] == "get_weather")
    call = {**task.data["calls"][0], "arguments": {"city": "Paris"}}
    return replace(task, data={**task.data, "calls": [call]})


PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_wrong_arguments_are_named() -> None:
    task = _task(1, lambda t: t.data["calls"][0]["name"] == "get_weather")
    city = task.data["calls"][0]["arguments"]["city"]
    args = {**task.data["calls"][0]["arguments"], "city": city.lower()}
    _, verdict = play(DOMAIN, task, [_block("get_weather", args)])
    assert verdict.reward == 0.0
    assert verdict.reason == f"argument city: got '{city.lower()}', expected '{city}'"
    _, verdict = play(DOMAIN, task, [_block("get_weather", {})])
    assert verdict.reason == "missing argument city"
    _, verdict = play(DOMAIN, task, [_block("get_weather", {**args, "city": city, "days": 3})])
    assert verdict.reason == "unexpected argument days"


@pytest.mark.parametrize(
    ("completion", "reason"),
    [
        ("It is sunny in Paris.", "no tool call"),
        (
            f"<think>\n<tool_call>\n{PARIS}\n</tool_call>\n</think>\n\nOK.",
            "no tool call (the one inside <think> does not count)",
        ),
        (
            f"<tool_call>\n{PARIS} trailing\n</tool_call>",
            "malformed tool call: a <tool_call> block is not valid JSON with a name",
        ),
        (_block("get_weather", '"{\\"city\\": \\"Paris\\""'), "malformed JSON arguments"),
        (_block("get_weather", '"[1, 2]"'), "malformed JSON arguments: not an object"),
        (
            _block("get_local_time", {"city": "Paris"}),
            "wrong tool get_local_time, expected get_weather",
        ),
        (
            _block("get_weather", {"city": "Paris"})
            + "\n"
            + _block("get_local_time", {"city": "Paris"}),
            "extra tool call get_local_time",
        ),
        (
            _block("get_weather", {"city": "Paris", "unit": "fahrenheit"}),
            "argument unit: got 'fahrenheit', expected 'celsius' (the default)",
        ),
    ],
)
def test_malformed_and_adversarial_turns_score_zero(completion: str, reason: str) -> None:
    task = _weather_paris()
    episode, verdict = play(DOMAIN, task, [completion])
    assert (verdict.reward, verdict.reason) == (0.0, reason)
    assert episode.done and episode.messages[-1]["role"] == "assistant"


def test_defaults_may_be_omitted_and_numbers_compare_by_value() -> None:
    task = _task(
        2,
        lambda t: (
            t.data["calls"][0]["name"] == "send_email"
            and t.data["calls"][0]["arguments"]["urgent"] is False
        ),
    )
    args = {k: v for k, v in task.data["calls"][0]["arguments"].items() if k != "urgent"}
    assert play(DOMAIN, task, [_block("send_email", args)])[1].reward == 1.0
    _, verdict = play(DOMAIN, task, [_block("send_email", {**args, "urgent": 0})])
    assert verdict.reason == "argument urgent: got 0, expected false"

    task = _task(2, lambda t: t.data["calls"][0]["name"] == "search_flights")
    args = task.data["calls"][0]["arguments"]
    as_float = {**args, "passengers": float(args["passengers"])}
    assert play(DOMAIN, task, [_block("search_flights", as_float)])[1].reward == 1.0
    as_text = {**args, "passengers": str(args["passengers"])}
    _, verdict = play(DOMAIN, task, [_block("search_flights", as_text)])
    assert verdict.reason.startswith("argument passengers: got '")
    without = {k: v for k, v in args.items() if k != "cabin"}
    _, verdict = play(DOMAIN, task, [_block("search_flights", without)])
    assert verdict.reason == ("missing argument cabin" if args["cabin"] != "economy" else "correct")


def test_multi_turn_partial_credit() -> None:
    task = DOMAIN.generate(0, 3)
    first, second = DOMAIN.reference(task, "short")[:2]
    name = task.data["calls"][1]["name"]

    _, verdict = play(DOMAIN, task, [first])
    assert (verdict.reward, verdict.reason) == (
        pytest.approx(1 / 3),
        f"ended before the call to {name}",
    )

    wrong = _block(name, {k: "x" for k in task.data["calls"][1]["arguments"]})
    episode, verdict = play(DOMAIN, task, [first, wrong, "done"])
    assert verdict.reward == pytest.approx(1 / 3) and verdict.reason.startswith("argument ")
    assert (
        verdict.metrics["steps"] == 2 and len(episode.messages) == 4
    )  # user, call, result, wrong call

    _, verdict = play(DOMAIN, task, [first, second, "All done!"])
    assert verdict.reward == pytest.approx(2 / 3)
    assert verdict.reason == f"the answer does not mention {task.data['key']!r}"

    hidden = f"<think>\nThe key is {task.data['key']}.\n</think>\n\nDone, see above."
    _, verdict = play(DOMAIN, task, [first, second, hidden])
    assert verdict.reason == f"the answer does not mention {task.data['key']!r}"

    _, verdict = play(DOMAIN, task, [first, second, second])
    assert verdict.reward == pytest.approx(2 / 3) and verdict.reason.startswith(
        "unexpected tool call"
    )

    _, verdict = play(DOMAIN, task, [second])
    assert (verdict.reward, verdict.metrics["steps"]) == (0.0, 1)


def test_tool_call_ids_are_reproducible() -> None:
    task = DOMAIN.generate(5, 3)
    turns = DOMAIN.reference(task, "think")
    assert play(DOMAIN, task, turns)[0].messages == play(DOMAIN, task, turns)[0].messages
    content, calls = parse_tool_calls(turns[0].split("</think>")[1])
    assert content == "" and calls[0].name == task.data["calls"][0]["name"]


def test_reference_conversations_render_through_the_chat_template(random_checkpoint) -> None:
    tokenizer = Tokenizer.from_dir(random_checkpoint)
    for difficulty in (1, 2, 3):
        for seed in range(5):
            task = DOMAIN.generate(seed, difficulty)
            for style in ("think", "short"):
                episode, _ = play(DOMAIN, task, DOMAIN.reference(task, style))
                text = tokenizer.apply_chat_template(
                    episode.messages, tools=task.tools, add_generation_prompt=False
                )
                assert "# Tools" in text and task.prompt in text
                for call in task.data["calls"]:
                    assert json.dumps(call["arguments"], ensure_ascii=False) in text
                if difficulty == 3:
                    assert text.count("<tool_response>") == 2 and task.data["key"] in text
                assert tokenizer.encode(text)


def test_picking_the_best_restates_the_best_after_each_comparison() -> None:
    prices = [("LH9172", 897), ("JL3101", 890), ("AF7", 906)]
    assert running_best(prices, "lower") == (
        "Best so far: LH9172 897; JL3101 890 is lower, best JL3101 890; "
        "AF7 906 is not lower, best stays JL3101 890."
    )
    ratings = [("r_1", 4.9), ("r_2", 4.1), ("r_3", 4.6)]
    assert running_best(ratings, "higher").endswith("best stays r_1 4.9.")


def test_the_note_states_arguments_in_the_order_the_request_gives_them() -> None:
    """A date or count the request words is converted where the request gives it."""
    flights = [t for t in (DOMAIN.generate(s, 2) for s in SEEDS) if t.prompt.startswith("We are")]
    assert len(flights) >= 3
    for task in flights:
        note = DOMAIN.reference(task, "think")[0].split("\n")[1]
        keys = ("passengers", "cabin", "origin", "destination", "date")
        at = [note.index(f"{key} ") for key in keys]
        assert at == sorted(at), note
        words = task.prompt.split()[2]  # "We are three people ..."
        assert f'passengers "{words}" = {task.data["calls"][0]["arguments"]["passengers"]}' in note
