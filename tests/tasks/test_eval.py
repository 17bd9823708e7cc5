"""The evaluation harness: references score 100%, a live server is measured, regressions fail."""

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tasks import DEFAULT_DOMAINS, opening_requests
from tasks.answers import parse_tool_calls, split_reasoning
from tasks.harness import assistant_text, regressions, report, run, summarize
from tasks.seeds import EVAL_SEED_BASE, eval_seed, train_seed

ALL = ["math", "code", "terminal", "tools"]


def test_seed_spaces_are_disjoint():
    assert eval_seed(0, 0) >= EVAL_SEED_BASE and eval_seed(7, 123) >= EVAL_SEED_BASE
    with pytest.raises(ValueError, match="held out"):
        train_seed(eval_seed(0, 5))
    assert train_seed(12) == 12


def test_assistant_text_round_trips_reasoning_and_tool_calls():
    message = {
        "content": "Let me check.",
        "reasoning_content": "The user wants the weather.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    text = assistant_text(message)
    reasoning, content = split_reasoning(text)
    assert reasoning == "The user wants the weather."
    rest, calls = parse_tool_calls(content)
    assert rest.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


@pytest.mark.parametrize("style", ["think", "short"])
def test_reference_solutions_score_full_marks(style):
    records = asyncio.run(run(ALL, [1, 2, 3], n=2, run_seed=0, concurrency=4, reference=style))
    assert len(records) == len(ALL) * 3 * 2
    failed = [(r.domain, r.difficulty, r.seed, r.reason) for r in records if r.reward < 1.0]
    assert not failed
    assert all(r.replies and all(r.replies) for r in records)  # each turn's text is kept
    assert {len(r.replies) for r in records if r.domain == "math"} == {1}
    rows = summarize(records)
    assert {r["domain"] for r in rows} == set(ALL)
    assert all(r["completion_rate"] == 1.0 for r in rows)


@pytest.fixture(scope="module")
def live_server(random_checkpoint: Path):
    """A real `tierserve engine` process on a free port, as users run it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-c",
        "from serving.cli import main; main()",
        "engine",
        "--model",
        str(random_checkpoint),
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--served-model-name",
        "tiny-moe",
        "--enforce-eager",
    ]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert server.poll() is None, "tierserve engine exited"
        assert time.monotonic() < deadline, "tierserve engine did not start"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    yield f"{url}/v1"
    server.terminate()
    server.wait(timeout=20)


def test_eval_against_a_live_server(live_server):
    records = asyncio.run(
        run(
            ["math", "tools"],
            [1],
            n=3,
            run_seed=1,
            concurrency=2,
            url=live_server,
            served_model="tiny-moe",
            max_tokens=24,
        )
    )
    assert len(records) == 6
    assert all(not r.reason.startswith("request failed") for r in records), records
    assert all(r.output_tokens and r.output_tokens > 0 and r.latency_s > 0 for r in records)
    math_rows = [r for r in summarize(records) if r["domain"] == "math"]
    assert math_rows[0]["completion_rate"] == 0.0  # random weights solve nothing


def test_regression_check_flags_a_drop():
    baseline = {"summary": [{"domain": "math", "difficulty": "all", "completion_rate": 0.9}]}
    ok = [{"domain": "math", "difficulty": "all", "completion_rate": 0.85}]
    bad = [{"domain": "math", "difficulty": "all", "completion_rate": 0.5}]
    assert regressions(ok, baseline, max_drop=10) == []
    assert "math" in regressions(bad, baseline, max_drop=10)[0]


def test_report_is_json():
    records = asyncio.run(run(["math"], [1], n=2, run_seed=3, concurrency=1, reference="short"))
    data = json.loads(json.dumps(report(records)))
    assert data["summary"][0]["n"] == 2 and len(data["records"]) == 2
    assert data["records"][0]["replies"] == [records[0].replies[0]]


def test_the_eval_command_against_a_live_server(live_server, tmp_path, capsys):
    from serving.cli import main

    out = tmp_path / "eval.json"
    main(
        [
            "eval",
            "tasks",
            "--url",
            live_server,
            "--served-model",
            "tiny-moe",
            "--domains",
            "math",
            "--n",
            "2",
            "--difficulty",
            "1",
            "--max-tokens",
            "8",
            "--json",
            str(out),
        ]
    )
    table = capsys.readouterr().out
    assert "| math | 1 | 2 |" in table and "| math | all | 2 |" in table
    assert json.loads(out.read_text())["summary"][0]["completion_rate"] == 0.0
    baseline = tmp_path / "baseline.json"
    baseline.write_text(
        json.dumps({"summary": [{"domain": "math", "difficulty": "all", "completion_rate": 1.0}]})
    )
    # The references score 100%: no regression, a normal return.
    main(
        [
            "eval",
            "tasks",
            "--reference",
            "short",
            "--domains",
            "math",
            "--n",
            "2",
            "--difficulty",
            "1",
            "--baseline",
            str(baseline),
        ]
    )
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "eval",
                "tasks",
                "--url",
                live_server,
                "--served-model",
                "tiny-moe",
                "--domains",
                "math",
                "--n",
                "2",
                "--difficulty",
                "1",
                "--max-tokens",
                "8",
                "--baseline",
                str(baseline),
            ]
        )
    assert exit_info.value.code == 1


def test_opening_requests_start_every_domain_easy_and_hard() -> None:
    """The load test's mix (serving/gateway/locustfile.py sends these)."""
    requests = opening_requests(per_kind=3)
    assert [r["kind"] for r in requests] == [
        f"{d}-{k}" for d in DEFAULT_DOMAINS for k in ("easy", "hard") for _ in range(3)
    ]
    assert all(r["messages"][-1]["role"] == "user" for r in requests)
    assert all((r["tools"] is not None) == r["kind"].startswith("tools") for r in requests)
    assert requests == opening_requests(per_kind=3)  # seeded: the same mix every run
