"""Writes the load test's prompts, `serving/gateway/locust_prompts.json`, from the task registry.

The locustfile ships inside the `serving` package (so a wheel can load-test) and `serving`
does not import `training`, so the prompts travel as data. Each is an easy (difficulty 1) or
hard (difficulty 3) task of a domain, as its first request (system prompt and tools
included), exactly as `tierserve eval` would start it. tests/serving/gateway/test_loadtest.py
checks that the shipped file equals what this writes.

    python loadtests/locust_prompts.py
"""

import json
from pathlib import Path
from typing import Any

from training.tasks import DOMAINS

OUT = Path(__file__).resolve().parents[1] / "serving" / "gateway" / "locust_prompts.json"
TASKS_PER_KIND = 16  # per domain and difficulty
SEED = 0


def build_prompts() -> list[dict[str, Any]]:
    prompts = []
    for name, domain in DOMAINS.items():
        for difficulty, label in ((1, "easy"), (3, "hard")):
            for i in range(TASKS_PER_KIND):
                item = domain.generate(SEED * 1000 + i, difficulty)
                episode = domain.start(item)
                messages = list(episode.messages)
                prompts.append(
                    {"kind": f"{name}-{label}", "messages": messages, "tools": item.tools}
                )
                episode.close()
    return prompts


def render(prompts: list[dict[str, Any]]) -> str:
    return json.dumps(prompts, ensure_ascii=False, indent=1) + "\n"


if __name__ == "__main__":
    OUT.write_text(render(build_prompts()), encoding="utf-8")
    print(OUT)
