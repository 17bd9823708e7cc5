"""The learned router's pipeline through the CLI: `tierserve eval tasks --json` outcomes of both
tiers -> `tierserve train router` -> `tierserve eval router` on held-out prompts.

The outcomes are the domains' reference solutions, with the highspeed tier's made to fail
the harder arithmetic (a synthetic but realistic gap): fast, and independent of how well the
shipped tiers happen to be trained."""

import asyncio
import json
import re
from pathlib import Path

import pytest

from router.evaluation import curve, random_curve
from router.learned import LearnedPolicy
from router.outcomes import OutcomeError, load_outcomes
from serving.cli import main
from tasks.harness import report, run


def write_outcomes(directory: Path, run_seed: int) -> tuple[Path, Path]:
    """Eval files of both tiers on the same held-out tasks of run `run_seed`."""
    paths = []
    for style in ("think", "short"):
        records = asyncio.run(
            run(["math", "tools"], [1, 2, 3], n=8, run_seed=run_seed, concurrency=4,
                reference=style)
        )  # fmt: skip
        data = report(records)
        if style == "short":
            for r in data["records"]:
                if r["domain"] == "math" and r["difficulty"] >= 2:
                    r["reward"] = 0.0
        path = directory / f"{style}-{run_seed}.json"
        path.write_text(json.dumps(data))
        paths.append(path)
    return paths[0], paths[1]


def test_train_and_evaluate_the_router(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    full, highspeed = write_outcomes(tmp_path, run_seed=0)
    record = json.loads(full.read_text())["records"][0]
    assert record["messages"][-1] == {"role": "user", "content": record["messages"][-1]["content"]}
    router = tmp_path / "router.npz"
    main(["train", "router", "--full", str(full), "--highspeed", str(highspeed),
          "--out", str(router), "--target-full-share", "0.4"])  # fmt: skip
    sent = re.search(r"sends ([\d.]+)% to full", capsys.readouterr().out)
    assert sent and abs(float(sent[1]) - 40) < 5  # the calibrated share of training prompts

    held_full, held_highspeed = write_outcomes(tmp_path, run_seed=1)
    main(["eval", "router", "--full", str(held_full), "--highspeed", str(held_highspeed),
          "--router", str(router)])  # fmt: skip
    table = capsys.readouterr().out
    for name in ("learned", "heuristic", "length", "random"):
        assert f"| {name} |" in table
    outcomes = load_outcomes(held_full, held_highspeed)
    policy = LearnedPolicy.load(router)
    learned = curve("learned", [policy.score(o.request) for o in outcomes], outcomes)
    assert learned.apgr > random_curve(len(outcomes)).apgr + 0.2


def test_outcome_files_must_pair_up(tmp_path: Path):
    (tmp_path / "a.json").write_text(json.dumps({"records": []}))
    (tmp_path / "b.json").write_text("{}")
    with pytest.raises(OutcomeError, match="share no task"):
        load_outcomes(tmp_path / "a.json", tmp_path / "a.json")
    with pytest.raises(OutcomeError, match="not a `tierserve eval tasks --json` file"):
        load_outcomes(tmp_path / "b.json", tmp_path / "a.json")


def test_bad_config_is_one_line_per_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "port: 0\ntiers:\n  full: {engine: remote, model: m}\n  highspeed: {model: x}\n"
    )
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--config", str(config)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "port: Input should be greater than or equal to 1" in err
    assert "tiers.full.remote.base_url: Field required" in err


def test_serve_refuses_missing_checkpoints(tmp_path, monkeypatch, capsys):
    """With no config the default tiers are the demo models; absent, it says so at once."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["serve"])
    assert exit_.value.code == 2
    assert "tiers.full.model: models/demo-full is not a checkpoint directory" in (
        capsys.readouterr().err
    )
