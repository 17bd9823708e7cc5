"""The retrieval table: cells by log length and needle depth from the harness's records, each
row's prompt tokens as the chat template makes them."""

import asyncio

from serving.model.tokenizer import Tokenizer
from tasks import harness
from tasks.base import Task
from tasks.retrieval import RetrievalDomain
from tests import REPO
from training.reports import retrieval

TOKENIZER = Tokenizer.from_dir(REPO / "models" / "demo-full")


def _play(tasks: list[Task], answer) -> list[harness.Record]:
    async def policy(task: Task, messages: list, turn: int) -> harness.Turn:
        return harness.Turn(answer(task), None, 0.0)

    domains = {"retrieval": RetrievalDomain()}
    return asyncio.run(harness.play_tasks(domains, tasks, policy, concurrency=3))


def test_cells_count_exact_answers_by_length_and_depth() -> None:
    tasks = retrieval.retrieval_tasks([4, 12], [0.0, 0.5, 1.0], n=3)
    assert len(tasks) == 18 and len({t.prompt for t in tasks}) == 18
    # Right only where the needle is the first line.
    records = _play(tasks, lambda t: str(t.data["answer"]) if t.data["depth"] == 0 else "200 ok")
    rows = retrieval.summarize(tasks, records, TOKENIZER)
    assert [r["lines"] for r in rows] == [4, 12]
    for row in rows:
        assert row["by_depth"] == {
            0.0: {"solved": 3, "n": 3}, 0.5: {"solved": 0, "n": 3}, 1.0: {"solved": 0, "n": 3},
        }  # fmt: skip
        assert (row["solved"], row["n"]) == (3, 9)
        low, high = row["ci"]
        assert low < 100 / 3 < high
    assert rows[0]["prompt_tokens"] < rows[1]["prompt_tokens"]
    expected = sum(retrieval.prompt_tokens(TOKENIZER, t) for t in tasks[:9]) / 9
    assert rows[0]["prompt_tokens"] == expected
    table = retrieval.format_table(rows)
    assert "| 4 | " in table and "100% (3/3) | 0% (0/3) | 0% (0/3) | 33% (" in table


def test_prompt_tokens_are_the_templated_prompt() -> None:
    task = retrieval.retrieval_tasks([8], [0.5], n=1)[0]
    templated = TOKENIZER.apply_chat_template([{"role": "user", "content": task.prompt}])
    assert retrieval.prompt_tokens(TOKENIZER, task) == len(TOKENIZER.encode(templated))
    assert retrieval.prompt_tokens(TOKENIZER, task) > len(TOKENIZER.encode(task.prompt))


def test_report_keeps_each_record_with_its_cell() -> None:
    tasks = retrieval.retrieval_tasks([4], [0.25, 0.75], n=2)
    records = _play(tasks, lambda t: str(t.data["answer"]))
    result = retrieval.report(tasks, records, TOKENIZER)
    assert [(r["lines"], r["depth"], r["reward"]) for r in result["records"]] == [
        (4, d, 1.0) for d in (0.25, 0.25, 0.75, 0.75)
    ]
    assert "messages" not in result["records"][0]
