"""Paired outcomes: the same held-out prompts played by both tiers (`tierserve eval tasks --json`),
joined on (domain, difficulty, seed). What the learned router trains on and what
`tierserve eval router` scores routers with."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.features import RouteRequest, route_request


class OutcomeError(ValueError):
    """Outcome files that cannot be read or paired, or that cannot rank routers."""


@dataclass(frozen=True)
class Outcome:
    request: RouteRequest
    domain: str
    full_passed: bool
    highspeed_passed: bool


def _records(path: Path) -> dict[tuple[str, int, int], dict[str, Any]]:
    try:
        records = json.loads(path.read_text())["records"]
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise OutcomeError(f"{path}: not a `tierserve eval tasks --json` file ({e})") from e
    by_task = {}
    for r in records:
        if not r.get("messages"):
            raise OutcomeError(
                f"{path}: records carry no messages; re-run `tierserve eval tasks --json` with "
                "this version"
            )
        by_task[(r["domain"], r["difficulty"], r["seed"])] = r
    return by_task


def load_outcomes(full_json: Path, highspeed_json: Path) -> list[Outcome]:
    """The tasks both files played, in a stable order; a task passes when its reward is 1."""
    full, highspeed = _records(full_json), _records(highspeed_json)
    shared = sorted(full.keys() & highspeed.keys())
    if not shared:
        raise OutcomeError(f"{full_json} and {highspeed_json} share no task")
    outcomes = []
    for key in shared:
        record = full[key]
        body = {"messages": record["messages"], "tools": record.get("tools")}
        outcomes.append(
            Outcome(
                route_request(body),
                record["domain"],
                full_passed=record["reward"] >= 1.0,
                highspeed_passed=highspeed[key]["reward"] >= 1.0,
            )
        )
    return outcomes
