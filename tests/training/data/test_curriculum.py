"""The SFT curriculum: easy examples first until copying is learned, the domain mix following
the measured losses, batches a pure function of the log; copy positions; natural prompts;
copy-dense pretraining text."""

import json
import random
from pathlib import Path

import pytest

from serving.model.tokenizer import Tokenizer
from tasks import get_domain
from training.config import CurriculumConfig, DataConfig
from training.data.copy_text import copy_document
from training.data.curriculum import Curriculum
from training.data.datasets import (
    SFTDataset,
    build_sft,
    chat_examples,
    copy_positions,
    pretrain_text,
)
from training.data.natural import CAPABILITIES, naturalize
from training.data.streams import sft_examples


def _dataset(tmp_path: Path) -> SFTDataset:
    rows = [
        {"domain": d, "difficulty": k, "prompt": [1, 2], "completion": [3], "copy": [0]}
        for d in ("math", "tools")
        for k in (1, 2, 3)
        for _ in range(5)
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return SFTDataset(path, 0)


def _row(step: int, copy: float, math: float = 1.0, tools: float = 1.0) -> dict:
    return {"step": step, "copy_loss": copy, "loss/math": math, "loss/tools": tools}


def test_first_phase_draws_difficulty_one_until_copying_is_learned(tmp_path: Path) -> None:
    data = _dataset(tmp_path)
    cfg = CurriculumConfig(enabled=True, copy_loss_threshold=0.5, max_first_steps=100, ema=0.5)
    curriculum = Curriculum(data, cfg, seed=0)
    log = [_row(0, 2.0)]
    first = curriculum.indices(1, 64, log)
    assert {data.rows[i]["difficulty"] for i in first} == {1}
    log += [_row(1, 0.3), _row(2, 0.2)]  # smoothed: 2.0 -> 1.15 -> 0.675: not yet
    assert {data.rows[i]["difficulty"] for i in curriculum.indices(3, 64, log)} == {1}
    log.append(_row(3, 0.1))  # 0.39 < 0.5
    assert {data.rows[i]["difficulty"] for i in curriculum.indices(4, 64, log)} == {1, 2, 3}


def test_first_phase_ends_at_its_step_cap(tmp_path: Path) -> None:
    cfg = CurriculumConfig(enabled=True, max_first_steps=2)
    curriculum = Curriculum(_dataset(tmp_path), cfg, seed=0)
    curriculum.sync([_row(0, 5.0)])
    assert curriculum.first_phase
    curriculum.sync([_row(0, 5.0), _row(1, 5.0)])
    assert not curriculum.first_phase


def test_the_domain_mix_follows_the_measured_loss(tmp_path: Path) -> None:
    cfg = CurriculumConfig(enabled=True, max_first_steps=0, min_share=0.1, ema=0.0)
    curriculum = Curriculum(_dataset(tmp_path), cfg, seed=0)
    assert curriculum.mix() == {"math": 0.5, "tools": 0.5}  # the data's own shares
    curriculum.sync([_row(0, 1.0, math=3.0, tools=1.0)])
    assert curriculum.mix() == pytest.approx({"math": 0.75, "tools": 0.25})
    curriculum.sync([_row(0, 1.0, math=3.0, tools=1.0), _row(1, 1.0, math=3.0, tools=0.0)])
    assert curriculum.mix()["tools"] == pytest.approx(0.1 / 1.1)  # the floor keeps it alive


def test_the_floor_never_lifts_a_domain_above_its_share_of_the_data(tmp_path: Path) -> None:
    rows = [{"domain": "math", "difficulty": 1, "prompt": [1], "completion": [3], "copy": []}] * 97
    rows += [{"domain": "other", "difficulty": 1, "prompt": [1], "completion": [3], "copy": []}] * 3
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = CurriculumConfig(enabled=True, max_first_steps=0, min_share=0.15, ema=0.0)
    curriculum = Curriculum(SFTDataset(path, 0), cfg, seed=0)
    curriculum.sync([{"step": 0, "copy_loss": 1.0, "loss/math": 1.0, "loss/other": 0.001}])
    assert curriculum.mix()["other"] == pytest.approx(0.03 / 1.03, rel=1e-3)


def test_batches_are_a_function_of_the_log_so_a_resume_draws_the_same(tmp_path: Path) -> None:
    data, cfg = _dataset(tmp_path), CurriculumConfig(enabled=True, ema=0.5, max_first_steps=3)
    log = [_row(s, 1.0 / (s + 1), math=2.0 - s / 4) for s in range(6)]
    straight = Curriculum(data, cfg, seed=7)
    drawn = [straight.indices(s, 8, log[:s]) for s in range(6)]
    resumed = Curriculum(data, cfg, seed=7)
    resumed.indices(5, 8, log[:5])  # a run that got further, then restarted from step 2
    assert [resumed.indices(s, 8, log[:s]) for s in range(2, 6)] == drawn[2:]


def test_annotate_turns_sums_into_losses(tmp_path: Path) -> None:
    curriculum = Curriculum(_dataset(tmp_path), CurriculumConfig(enabled=True), seed=0)
    row = {"step": 0, "copy_ce_sum": 6.0, "copy_n": 3.0, "ce_sum/math": 4.0, "n/math": 2.0}
    row |= {"ce_sum/tools": 0.0, "n/tools": 0.0}
    curriculum.annotate(row)
    assert row["copy_loss"] == 2.0 and row["loss/math"] == 2.0 and row["loss/tools"] is None
    assert row["phase"] == 1 and "copy_ce_sum" not in row


@pytest.fixture(scope="module")
def tokenizer(random_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(random_checkpoint)


def test_copy_positions_are_the_values_taken_from_the_request(tokenizer: Tokenizer) -> None:
    domain = get_domain("tools")
    example = next(sft_examples(domain, [11], [1], "short"))
    messages, turn = example["turns"][0]
    completion = tokenizer.encode(turn)
    copied = tokenizer.decode([completion[j] for j in copy_positions(
        messages, example["tools"], completion, tokenizer
    )])  # fmt: skip
    call = json.loads(turn.split("\n")[1])
    assert call["name"].split("_")[0] in copied
    for value in call["arguments"].values():
        assert str(value).split()[0] in copied
    assert "<tool_call>" not in copied


@pytest.mark.parametrize("domain", ["math", "code", "terminal", "tools"])
def test_natural_prompts_keep_the_reference_correct(domain: str) -> None:
    """sft_examples raises when a reference does not verify, so every reworded task is
    still solved by its reference; the prompts differ from the generator's."""
    examples = list(sft_examples(get_domain(domain), range(6), [1, 2, 3], "think", natural=1.0))
    plain = list(sft_examples(get_domain(domain), range(6), [1, 2, 3], "think"))
    users = [next(m for m in e["messages"] if m["role"] == "user") for e in examples]
    originals = [next(m for m in e["messages"] if m["role"] == "user") for e in plain]
    changed = sum(u != o for u, o in zip(users, originals, strict=True))
    assert changed >= (0 if domain == "terminal" else len(users) // 2)
    assert any(e["messages"][0]["role"] == "system" for e in examples)


def test_math_rewording_keeps_the_expression_readable() -> None:
    task = get_domain("math").generate(3, 2)
    prompts = {naturalize(task, random.Random(i))[0].prompt for i in range(40)}
    assert len(prompts) > 10
    digits = "".join(c for c in task.data["expression"] if c.isdigit())
    assert all("".join(c for c in p if c.isdigit()) == digits for p in prompts)


def test_out_of_domain_requests_get_the_capabilities(tokenizer: Tokenizer, tmp_path) -> None:
    data = DataConfig(examples=40, out_of_domain=0.25, seed=3)
    other = [e for e in chat_examples(data, "short") if e["domain"] == "other"]
    assert 4 <= len(other) <= 20 and all(e["turns"][0][1] == CAPABILITIES for e in other)
    path = build_sft(data, "think", tokenizer, tmp_path / "sft.jsonl", 1024)
    rows = SFTDataset(path, 0).rows
    assert {r["domain"] for r in rows} == {"math", "code", "terminal", "tools", "other"}


def test_copy_documents_ask_only_for_what_came_before() -> None:
    for seed in range(30):
        for exercise in copy_document(seed).split("\n\n"):
            lines = exercise.splitlines()
            if lines[0].startswith(("Text: ", "List: ")):
                assert lines[1].split(": ", 1)[1] == lines[0].split(": ", 1)[1]
            elif lines[0].startswith("Values: "):
                values = lines[0].removeprefix("Values: ").split(", ")
                assert list(json.loads(lines[1].removeprefix("As JSON: ")).values()) == values
            else:
                table = dict(line.split(" = ") for line in lines if " = " in line)
                for line in lines:
                    if line.startswith("What is "):
                        key, value = line.removeprefix("What is ").split("? ", 1)
                        assert table[key] == value


def test_pretraining_text_mixes_in_copy_documents() -> None:
    docs = list(pretrain_text(DataConfig(examples=60, copy_docs=0.5, seed=1)))
    copies = sum(doc.startswith(("Text: ", "List: ", "Values: ", "k")) for doc in docs)
    assert 15 <= copies <= 45
