"""The shipped full tier on requests written as people write them, not as the generators do.

Twenty hand-written requests per domain, played greedily through the tier's own OpenAI app
and scored by the domains' verifiers: math by the final integer, code by hidden tests in the
sandbox, terminal by the final file tree (a held-out task whose one task sentence is
reworded; the shell protocol around it is the agent harness's, not the user's words), tools
by the exact call, against bank schemas and schemas the model never saw. The bars are what
the shipped model achieves (the target: 60% of the 80); the test prints the rates.
"""

import asyncio
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from serving.api_server.api_server import build_app
from serving.engine.async_engine import AsyncEngine
from serving.engine.llm_engine import EngineConfig, LLMEngine
from tasks import Task, get_domain
from tasks.harness import Turn, chat_policy, play_episode
from tasks.seeds import eval_seed
from tasks.tool_bank import BANK
from tasks.tool_tasks import call
from tests import REPO

FULL = REPO / "models" / "demo-full"
# The completion rate the shipped demo-full reaches on each domain's 20 requests (greedy), in
# fp32. Math: 20 of 20 and tools: 6 of 20 (0.3), each with one request of margin for a
# machine's native bf16 rounding. Together 0.6 of the 80 at least, the target (the
# model reaches 0.675; the one before it, too, with math 0.9 and code 0.65).
BARS = {"math": 0.95, "code": 0.55, "terminal": 0.85, "tools": 0.25}

MATH = [
    ("What is 17 * 23?", 391),
    ("How much is 48 + 37?", 85),
    ("what's 96 - 58", 38),
    ("Can you calculate 125 + 67 for me?", 192),
    ("12 times 9?", 108),
    ("Quick one: 73 - 29", 44),
    ("What do you get if you add 56 and 38?", 94),
    ("Please compute 7 * 8 + 5.", 61),
    ("what is 250 - 75?", 175),
    ("Solve: 15 + 27 - 9", 33),
    ("How much is 6 x 14?", 84),
    ("Hey, what's 81 + 19?", 100),
    ("calculate (12 + 8) * 3", 60),
    ("What's 300 minus 45?", 255),
    ("What is 9 * 9 - 1?", 80),
    ("Could you tell me what 64 + 128 is?", 192),
    ("45 * 2 = ?", 90),
    ("What's the sum of 23 and 58?", 81),
    ("Multiply 13 by 7.", 91),
    ("Subtract 19 from 100.", 81),
]

CODE: list[tuple[str, str, list[list[Any]]]] = [
    ("Write a Python function solve(xs) that returns the largest number in xs", "int",
     [[[1, 5, 3], 5], [[-2, -7], -2], [[4], 4], [[10, 30, 20], 30]]),
    ("write solve(xs) in python: return the sum of the list xs", "int",
     [[[1, 2, 3], 6], [[], 0], [[-5, 5, 7], 7]]),
    ("I need a python function solve(s) that reverses the string s", "str",
     [["abc", "cba"], ["", ""], ["hello world", "dlrow olleh"]]),
    ("Python: solve(n) should return n squared", "int", [[3, 9], [-4, 16], [0, 0]]),
    ("Write solve(xs) which returns how many even numbers are in xs", "int",
     [[[1, 2, 4], 2], [[], 0], [[3, 5], 0], [[0, -2, 7], 2]]),
    ("Make a function solve(s) that returns s in upper case", "str",
     [["abc", "ABC"], ["Hi there", "HI THERE"], ["", ""]]),
    ("solve(xs): return xs sorted from smallest to largest, in Python", "list",
     [[[3, 1, 2], [1, 2, 3]], [[], []], [[5, -1, 5], [-1, 5, 5]]]),
    ("Write a Python function solve(n) that returns the sum of the digits of n", "int",
     [[123, 6], [0, 0], [9999, 36]]),
    ("Can you write solve(xs) that gives the smallest number in the list xs?", "int",
     [[[4, 2, 8], 2], [[-1, -9], -9], [[7], 7]]),
    ("Python function solve(s) returning the number of vowels in s", "int",
     [["hello", 2], ["sky", 0], ["aeiou", 5]]),
    ("solve(xs) should return xs without duplicates, keeping the first occurrence of each",
     "list", [[[1, 2, 1, 3, 2], [1, 2, 3]], [[], []], [[5, 5, 5], [5]]]),
    ("Write solve(s) that returns the number of words in s", "int",
     [["hello world", 2], ["one", 1], ["a b c d", 4]]),
    ("Write a Python function solve(xs) that returns a list with every number doubled", "list",
     [[[1, 2, 3], [2, 4, 6]], [[], []], [[-1, 0], [-2, 0]]]),
    ("Please write solve(n) that returns True if n is even and False otherwise", "bool",
     [[4, True], [7, False], [0, True], [-3, False]]),
    ("Write solve(xs) returning the last element of xs", "int",
     [[[1, 2, 3], 3], [[9], 9], [[4, -4], -4]]),
    ("write a python function solve(s) that returns the length of the string s", "int",
     [["abc", 3], ["", 0], ["hello world", 11]]),
    ("Write a function solve(xs) in Python that returns the numbers in xs greater than 10",
     "list", [[[5, 11, 20, 10], [11, 20]], [[], []], [[1, 2], []]]),
    ("Implement solve(n) returning the absolute value of n", "int",
     [[-5, 5], [3, 3], [0, 0]]),
    ("Write solve(xs) that returns xs reversed", "list",
     [[[1, 2, 3], [3, 2, 1]], [[], []], [[7, 7, 1], [1, 7, 7]]]),
    ("Write a Python function solve(s) that removes all spaces from s", "str",
     [["a b c", "abc"], ["nospace", "nospace"], [" x ", "x"]]),
]  # fmt: skip

# Each held-out terminal task's sentence, as a user would put it (two ways each).
TERMINAL = {
    "Print the number of lines containing ERROR across the .log files in logs/.": (
        "how many lines in the .log files in logs/ contain ERROR?",
        "count the ERROR lines in logs/*.log and print the count",
    ),
    "Print the number of lines containing ERROR across the .log files anywhere under logs/ "
    "(including its subdirectories).": (
        "how many ERROR lines are there in all the .log files under logs/, subfolders included?",
        "count lines with ERROR in every .log file under logs/, recursively, and print it",
    ),
    "Move every .log file in logs/ directly into archive/ and print how many files you moved.": (
        "move the .log files in logs/ to archive/ and tell me how many you moved",
        "put all logs/*.log into archive/, then print the number of files moved",
    ),
    "Move every .log file anywhere under logs/ (including its subdirectories) directly into "
    "archive/ and print how many files you moved.": (
        "move all .log files from logs/ and its subfolders straight into archive/ and print how "
        "many there were",
        "find every .log under logs/ at any depth, move them into archive/ and print the count",
    ),
    "Delete every empty file in src/.": (
        "remove the empty files in src/",
        "please delete all zero-byte files in src/",
    ),
    "Delete every empty file anywhere under src/ (including its subdirectories).": (
        "delete all empty files under src/, subdirectories included",
        "clean up: remove every empty file anywhere in src/",
    ),
    "Rename every .txt file in data/ so that it ends in .md instead (same name and directory "
    "otherwise).": (
        "rename the .txt files in data/ to .md",
        "change the extension of every .txt file in data/ to .md",
    ),
    "Rename every .txt file anywhere under data/ (including its subdirectories) so that it ends "
    "in .md instead (same name and directory otherwise).": (
        "rename all .txt files under data/ (subfolders too) to .md, keeping them where they are",
        "every .txt anywhere under data/ should become .md",
    ),
    "Print the total size in bytes of all the files in data/.": (
        "what's the total size in bytes of the files in data/?",
        "print how many bytes the files in data/ take up in total",
    ),
    "Print the total size in bytes of all the files anywhere under data/ (including its "
    "subdirectories).": (
        "total size in bytes of everything under data/, subdirectories included?",
        "add up the sizes of all files under data/ recursively and print the bytes",
    ),
    "Create report.txt in the working directory listing the file names (without directories) "
    "of the .csv files in data/, sorted, one per line.": (
        "write the names of the .csv files in data/ into report.txt, sorted, one per line, no "
        "paths",
        "make a report.txt with the sorted list of csv file names from data/ (just the names)",
    ),
    "Create report.txt in the working directory listing the file names (without directories) "
    "of the .csv files anywhere under data/ (including its subdirectories), sorted, one per "
    "line.": (
        "list the names of all .csv files under data/ including subfolders into report.txt, "
        "sorted, one per line, names only",
        "create report.txt: sorted names (no directories) of every .csv anywhere in data/",
    ),
}


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _s(description: str) -> dict[str, str]:
    return {"type": "string", "description": description}


def _n(description: str) -> dict[str, str]:
    return {"type": "number", "description": description}


UNSEEN = {
    "get_current_weather": _tool(
        "get_current_weather",
        "Get the current weather for a location.",
        {"location": _s("City name"), "unit": {**_s("Unit"), "enum": ["c", "f"], "default": "c"}},
        ["location"],
    ),
    "get_time_zone": _tool("get_time_zone", "The time zone of a city.", {"city": _s("City")},
                           ["city"]),
    "calculate_tip": _tool(
        "calculate_tip",
        "Compute the tip for a restaurant bill.",
        {"bill_amount": _n("Bill in dollars"), "tip_percent": _n("Tip percentage")},
        ["bill_amount", "tip_percent"],
    ),
    "play_song": _tool("play_song", "Play a song.", {"title": _s("Song title"),
                       "artist": _s("Artist")}, ["title", "artist"]),
    "get_news": _tool("get_news", "Latest news headlines on a topic.", {"topic": _s("Topic")},
                      ["topic"]),
    "add_todo": _tool("add_todo", "Add an item to the to-do list.", {"task": _s("The item")},
                      ["task"]),
    "get_distance": _tool(
        "get_distance",
        "Driving distance between two cities.",
        {"from_city": _s("Start city"), "to_city": _s("Destination city")},
        ["from_city", "to_city"],
    ),
    "send_sms": _tool(
        "send_sms",
        "Send a text message.",
        {"phone_number": _s("Recipient's number"), "message": _s("Text to send")},
        ["phone_number", "message"],
    ),
    "define_word": _tool("define_word", "Dictionary definition of an English word.",
                         {"word": _s("The word")}, ["word"]),
    "get_exchange_rate": _tool(
        "get_exchange_rate",
        "Exchange rate between two currencies.",
        {"base": _s("ISO code of the base currency"), "quote": _s("ISO code of the quote")},
        ["base", "quote"],
    ),
}  # fmt: skip

# (request, the tools offered, the expected call's name and arguments)
TOOLS: list[tuple[str, list[str], str, dict[str, Any]]] = [
    ("What's the weather like in Lisbon right now?", ["get_weather", "get_local_time"],
     "get_weather", {"city": "Lisbon"}),
    ("what time is it in Tokyo", ["set_timer", "get_local_time", "get_weather"],
     "get_local_time", {"city": "Tokyo"}),
    ("Convert 250 EUR to USD please", ["get_stock_price", "convert_currency"],
     "convert_currency", {"amount": 250, "from_currency": "EUR", "to_currency": "USD"}),
    ("set a timer for 15 minutes", ["create_event", "set_timer"], "set_timer", {"minutes": 15}),
    ("How is AAPL doing today?", ["get_stock_price", "search_products"], "get_stock_price",
     {"symbol": "AAPL"}),
    ("Find me some thai food in Bangkok", ["find_restaurants", "get_weather"],
     "find_restaurants", {"city": "Bangkok", "cuisine": "thai"}),
    ("Look up the contact details for Maria Garcia", ["send_email", "lookup_contact"],
     "lookup_contact", {"name": "Maria Garcia"}),
    ("translate 'thank you very much' into japanese", ["translate_text", "get_local_time"],
     "translate_text", {"text": "thank you very much", "target_language": "japanese"}),
    ("I'd like the bedroom at 21 degrees", ["get_weather", "set_thermostat"], "set_thermostat",
     {"temperature": 21, "room": "bedroom"}),
    ("Search for wireless headphones", ["search_products", "get_stock_price"],
     "search_products", {"query": "wireless headphones"}),
    ("What's the weather like in Paris?", ["get_current_weather", "get_news"],
     "get_current_weather", {"location": "Paris"}),
    ("Which time zone is Denver in?", ["get_time_zone", "get_distance"], "get_time_zone",
     {"city": "Denver"}),
    ("What's a 15% tip on an 80 dollar bill?", ["calculate_tip", "get_exchange_rate"],
     "calculate_tip", {"bill_amount": 80, "tip_percent": 15}),
    ("Play Yesterday by The Beatles", ["play_song", "add_todo"], "play_song",
     {"title": "Yesterday", "artist": "The Beatles"}),
    ("Any news about electric cars?", ["get_news", "define_word"], "get_news",
     {"topic": "electric cars"}),
    ("Add buy milk to my to-do list", ["add_todo", "send_sms"], "add_todo", {"task": "buy milk"}),
    ("How far is it from Berlin to Munich?", ["get_distance", "get_time_zone"], "get_distance",
     {"from_city": "Berlin", "to_city": "Munich"}),
    ("Text +15551234567 saying I'm running late", ["send_sms", "play_song"], "send_sms",
     {"phone_number": "+15551234567", "message": "I'm running late"}),
    ("What does ephemeral mean?", ["define_word", "get_news"], "define_word",
     {"word": "ephemeral"}),
    ("What's the exchange rate from GBP to JPY?", ["get_exchange_rate", "calculate_tip"],
     "get_exchange_rate", {"base": "GBP", "quote": "JPY"}),
]  # fmt: skip


def _schema(name: str) -> dict:
    return BANK[name] if name in BANK else UNSEEN[name]


def natural_tasks() -> list[Task]:
    """The 80 requests as tasks the domains' episodes play and verify."""
    tasks = [Task("math", i, 1, p, {"answer": a}) for i, (p, a) in enumerate(MATH)]
    tasks += [
        Task("code", i, 1, p, {"tests": tests, "returns": returns})
        for i, (p, returns, tests) in enumerate(CODE)
    ]
    terminal = get_domain("terminal")
    for i in range(20):
        task = terminal.generate(eval_seed(15, i), 1 + i % 2)
        sentence = re.search(r"Task: (.*)\n", task.prompt)
        assert sentence is not None
        natural = TERMINAL[sentence[1]][i // 2 % 2]
        tasks.append(dataclasses.replace(task, prompt=task.prompt.replace(sentence[1], natural)))
    tasks += [
        Task(
            "tools",
            i,
            1,
            p,
            {"calls": [call(name, arguments, None, "")], "key": None, "answer": None},
            [_schema(n) for n in offered],
        )
        for i, (p, offered, name, arguments) in enumerate(TOOLS)
    ]
    return tasks


async def _play(model_dir: Path, tasks: list[Task]) -> dict[str, list[float]]:
    engine = AsyncEngine(LLMEngine.from_checkpoint(model_dir, EngineConfig(max_num_seqs=40)))
    assert engine.engine.tokenizer is not None
    rewards: dict[str, list[float]] = {}
    try:
        app = build_app(engine, engine.engine.tokenizer, "full")
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t/v1/") as client:
            policy = chat_policy(client, "full", 384, 0.0)
            records = await asyncio.gather(
                *(play_episode(get_domain(t.domain), t, policy) for t in tasks)
            )
    finally:
        engine.stop()
    for record in records:
        rewards.setdefault(record.domain, []).append(float(record.reward == 1.0))
    return rewards


SOLUTIONS = [
    "max(xs)", "sum(xs)", "s[::-1]", "n * n", "len([x for x in xs if x % 2 == 0])", "s.upper()",
    "sorted(xs)", "sum(int(c) for c in str(abs(n)))", "min(xs)",
    "sum(c in 'aeiou' for c in s)", "list(dict.fromkeys(xs))", "len(s.split())",
    "[2 * x for x in xs]", "n % 2 == 0", "xs[-1]", "len(s)", "[x for x in xs if x > 10]",
    "abs(n)", "xs[::-1]", "s.replace(' ', '')",
]  # fmt: skip


def _correct(task: Task, turn: int) -> str:
    """A right answer to each request, to check the requests and their verdicts."""
    if task.domain == "math":
        return str(task.data["answer"])
    if task.domain == "code":
        param = re.search(r"solve\((\w+)\)", task.prompt)
        assert param is not None
        body = SOLUTIONS[task.seed]
        return f"```python\ndef solve({param[1]}):\n    return {body}\n```"
    if task.domain == "terminal":
        turns = get_domain("terminal").reference(task, "short")
        return turns[min(turn, len(turns) - 1)]
    expected = task.data["calls"][0]
    body = json.dumps({"name": expected["name"], "arguments": expected["arguments"]})
    return f"<tool_call>\n{body}\n</tool_call>"


def test_every_request_is_solvable_and_verified() -> None:
    async def policy(task: Task, messages: list[dict[str, Any]], turn: int) -> Turn:
        return Turn(_correct(task, turn), None, 0.0)

    async def play_all() -> list[float]:
        tasks = natural_tasks()
        records = await asyncio.gather(
            *(play_episode(get_domain(t.domain), t, policy) for t in tasks)
        )
        return [r.reward for r in records]

    assert asyncio.run(play_all()) == [1.0] * 80


@pytest.mark.timeout(300)
def test_the_full_tier_answers_natural_requests() -> None:
    tasks = natural_tasks()
    assert [sum(t.domain == d for t in tasks) for d in BARS] == [20, 20, 20, 20]
    rewards = asyncio.run(_play(FULL, tasks))
    rates = {d: sum(r) / len(r) for d, r in rewards.items()}
    print("natural-phrasing completion:", rates)
    for domain, bar in BARS.items():
        assert rates[domain] >= bar, (domain, rates)
    assert sum(rates.values()) / len(rates) >= 0.6, rates
