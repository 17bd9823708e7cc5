"""Routing policies: features, the heuristic, calibration, the learned classifier, spill,
cascade validators and the quality-vs-cost metrics."""

import random
import statistics
import time

import numpy as np
import pytest

from router.calibration import threshold_for_share
from router.cascade import validate_answer
from router.evaluation import curve, random_curve
from router.features import domain, features, route_request
from router.heuristic import HeuristicPolicy
from router.learned import LearnedPolicy, RouterFileError, train
from router.outcomes import Outcome
from router.policy import Decision
from router.spill import SpillPolicy


def chat(text: str, **body) -> dict:
    return {"messages": [{"role": "user", "content": text}], **body}


EASY = chat("Hi, how are you?")
HARD = chat(
    "Compute 981 - (58 - 712) * 89 + 4410 * (27 - 3). First explain each step, then for "
    "each product show the partial sums, and finally answer with the integer only."
)


def test_features_read_the_request():
    request = route_request(HARD)
    values = features(request)
    assert domain(request) == "math"
    assert values["operations"] >= 1.0 and values["multi_step"] >= 1.0
    tools = route_request(chat("Weather in Paris?", tools=[{"type": "function"}]))
    assert domain(tools) == "tools" and features(tools)["tools"] == 1.0
    code = route_request(chat("Write a Python function solve(xs) that sorts xs."))
    assert domain(code) == "code"
    deep = route_request(
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 4}
    )
    assert deep.assistant_turns == 4 and features(deep)["depth"] > 1
    parts = route_request(chat([{"type": "text", "text": "12 + 30"}]))
    assert "12 + 30" in parts.text
    assert route_request({"prompt": ["abc", "def"]}).text == "abc\ndef"


def test_heuristic_scores_hard_above_easy():
    policy = HeuristicPolicy()
    assert policy.score(route_request(HARD)) > policy.threshold > policy.score(route_request(EASY))


def test_router_costs_well_under_a_millisecond():
    """The typical cost; bench_gateway.py reports the p99 on an idle machine."""
    data = _synthetic(50, 0)
    learned = train([o.request for o in data], [not o.highspeed_passed for o in data], 0.5)
    long_chat = chat(" ".join(HARD["messages"][0]["content"] for _ in range(20)))
    for policy in (HeuristicPolicy(), learned):
        timings = []
        for _ in range(200):
            start = time.perf_counter()
            policy.score(route_request(long_chat))
            timings.append(time.perf_counter() - start)
        assert statistics.median(timings) < 1e-3


def test_calibration_hits_the_target_share():
    scores = np.random.default_rng(0).random(1000)
    for share in (0.0, 0.1, 0.5, 0.8, 1.0):
        threshold = threshold_for_share(scores, share)
        assert np.mean(scores >= threshold) == pytest.approx(share, abs=1e-3)
    with pytest.raises(ValueError):
        threshold_for_share(scores, 1.5)


def _synthetic(n: int, seed: int) -> list[Outcome]:
    """Prompts whose highspeed outcome depends on a word: `multiply` tasks fail there."""
    rng = random.Random(seed)
    outcomes = []
    for i in range(n):
        hard = rng.random() < 0.4
        verb = "multiply" if hard else "add"
        text = f"Please {verb} {rng.randint(1, 99)} and {rng.randint(1, 99)} for case {i}."
        outcomes.append(
            Outcome(route_request(chat(text)), "math", full_passed=True, highspeed_passed=not hard)
        )
    return outcomes


def test_learned_router_learns_and_round_trips(tmp_path):
    data = _synthetic(200, 0)
    policy = train([o.request for o in data], [not o.highspeed_passed for o in data], 0.4)
    held_out = _synthetic(100, 1)
    scores = [policy.score(o.request) for o in held_out]
    learned = curve("learned", scores, held_out)
    hard_share = np.mean([not o.highspeed_passed for o in held_out])
    assert learned.cpt(1.0) <= hard_share + 0.05  # nearly the oracle: hard ones first
    assert learned.apgr > random_curve(100).apgr + 0.2
    path = tmp_path / "router.npz"
    policy.save(path)
    loaded = LearnedPolicy.load(path)
    assert loaded.threshold == policy.threshold
    assert loaded.score(held_out[0].request) == pytest.approx(scores[0], rel=1e-5)
    (tmp_path / "bad.npz").write_bytes(b"nope")
    with pytest.raises(RouterFileError):
        LearnedPolicy.load(tmp_path / "bad.npz")


def test_pgr_curve_metrics():
    outcomes = _synthetic(50, 2)
    perfect = curve("oracle", [float(not o.highspeed_passed) for o in outcomes], outcomes)
    share_hard = np.mean([not o.highspeed_passed for o in outcomes])
    assert perfect.cpt(1.0) == pytest.approx(share_hard)
    assert perfect.pgr_at(1.0) == 1.0 and perfect.pgr_at(0.0) == 0.0
    # A constant score is one big tie: exactly random routing in expectation.
    flat = curve("flat", [0.5] * len(outcomes), outcomes)
    np.testing.assert_allclose(flat.pgr, random_curve(len(outcomes)).pgr)
    assert flat.apgr == pytest.approx(0.5) and flat.cpt(0.8) == pytest.approx(0.8)


def test_spill_moves_only_when_the_other_tier_has_room():
    spill = SpillPolicy(max_queue=4, margin=0.1)
    to_full = Decision("full", "heuristic", "score_above_threshold", 0.55)
    assert spill.apply(to_full, 0.5, {"full": 4, "highspeed": 0}).reason == "spill"
    assert spill.apply(to_full, 0.5, {"full": 4, "highspeed": 4}).tier == "full"
    assert spill.apply(to_full, 0.5, {"full": 3, "highspeed": 0}).tier == "full"
    very_hard = Decision("full", "heuristic", "score_above_threshold", 0.9)
    assert spill.apply(very_hard, 0.5, {"full": 9, "highspeed": 0}).tier == "full"
    easy = Decision("highspeed", "heuristic", "score_below_threshold", 0.1)
    assert spill.apply(easy, 0.5, {"full": 0, "highspeed": 4}).tier == "full"


def _answer(content: str | None, finish: str = "stop", **message) -> dict:
    return {
        "choices": [
            {
                "finish_reason": finish,
                "message": {"role": "assistant", "content": content, **message},
            }
        ]
    }


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize(
    ("body", "answer", "failure"),
    [
        (EASY, _answer("Fine."), None),
        (EASY, _answer("Fine, and", finish="length"), "truncated"),
        (chat("x", response_format={"type": "json_object"}), _answer('{"a": 1}'), None),
        (chat("x", response_format={"type": "json_object"}), _answer("[1]"), "invalid_json"),
        (
            chat(
                "x",
                response_format={
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object", "required": ["a"]}},
                },
            ),
            _answer('{"b": 1}'),
            "schema_mismatch",
        ),
        (HARD, _answer("The answer is 59187"), None),
        (HARD, _answer("I cannot say."), "no_final_number"),
        (
            chat("Write a Python function solve(xs)."),
            _answer("```python\ndef solve(xs):\n  return xs\n```"),
            None,
        ),
        (
            chat("Write a Python function solve(xs)."),
            _answer("```python\ndef solve(:\n```"),
            "no_valid_code",
        ),
    ],
)
def test_cascade_validators(body, answer, failure):
    assert validate_answer(body, answer) == failure


def test_cascade_checks_tool_arguments_against_their_schema():
    body = chat("Weather in Paris?", tools=[WEATHER])

    def call(name: str, arguments: str) -> dict:
        calls = [
            {"id": "1", "type": "function", "function": {"name": name, "arguments": arguments}}
        ]
        return _answer(None, tool_calls=calls)

    assert validate_answer(body, call("get_weather", '{"city": "Paris"}')) is None
    assert (
        validate_answer(body, call("get_weather", '{"town": "Paris"}')) == "invalid_tool_arguments"
    )
    assert validate_answer(body, call("get_weather", "{city")) == "invalid_tool_arguments"
    assert validate_answer(body, call("get_time", "{}")) == "unknown_tool"


def test_route_request_reads_only_well_formed_text_parts() -> None:
    # Found by the gateway fuzzer: a part whose text is null made routing raise (a 500);
    # routing must pass such a request on, for the tier to reject it with a 400.
    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"text": None}, {"type": "text", "text": "What is 2 + 2?"}],
            },
            {"role": "user", "content": [{"text": 1.5}, "bare string", None]},
        ]
    }
    assert route_request(body).text == "What is 2 + 2?\n"
