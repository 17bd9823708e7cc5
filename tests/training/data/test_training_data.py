"""Tokenized training sets and stage configs: what the trainer is fed."""

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from serving.model.tokenizer import Tokenizer
from training.config import ConfigError, DataConfig
from training.data.datasets import (
    BUILD_THREADS,
    IGNORE,
    PretrainDataset,
    SampleOrder,
    SFTDataset,
    build_pretrain,
    build_sft,
    chat_examples,
    draw_tasks,
    in_order,
    pretrain_text,
)
from training.data.tokenizer import PAD_TOKEN
from training.stages.run import load_stage_config
from training.stages.sft import SFTStage

MIX = {"math": 1.0, "terminal": 1.0, "tools": 1.0}


@pytest.fixture(scope="module")
def tokenizer(random_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(random_checkpoint)


def test_sft_examples_are_prompted_as_the_server_prompts(tokenizer, tmp_path: Path) -> None:
    data = DataConfig(examples=12, mix=MIX, difficulties=[1])
    path = build_sft(data, "think", tokenizer, tmp_path / "sft.jsonl", seq_len=2048)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    eos = tokenizer.raw.token_to_id(tokenizer.eos_token)
    assert len(rows) > 12  # terminal episodes give one example per assistant turn
    for row in rows:
        prompt = tokenizer.decode(row["prompt"], skip_special_tokens=False)
        assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n")
        assert row["completion"][-1] == eos
    math_row = next(r for r in rows if r["domain"] == "math")
    assert tokenizer.decode(math_row["completion"]).startswith("<think>\n")
    dataset = SFTDataset(path, tokenizer.raw.token_to_id(PAD_TOKEN))
    batch = dataset.collate([0, 1, 2])
    for b in range(3):
        row = dataset.rows[b]
        targets = batch.labels[b][batch.labels[b] != IGNORE].tolist()
        assert targets == row["completion"]  # loss on the completion only, all of it
        real = int(batch.padding_mask[b].sum())
        assert batch.input_ids[b, :real].tolist() == (row["prompt"] + row["completion"])[:-1]


def test_distillation_rows_line_the_teachers_answer_up_with_the_students(
    tokenizer, tmp_path: Path
) -> None:
    """Short-style rows built with a teacher: the student completes with the answer alone
    (math, whose short style keeps its working, with the whole think turn), the teacher
    reads its reasoning first, and only the answer's tokens are labelled in both, in the
    same order, so position i of one is position i of the other."""
    data = DataConfig(examples=12, mix=MIX, difficulties=[1, 2])
    path = build_sft(data, "short", tokenizer, tmp_path / "sft.jsonl", 2048, teacher=True)
    dataset = SFTDataset(path, tokenizer.raw.token_to_id(PAD_TOKEN))
    think = tokenizer.raw.token_to_id("<think>")
    assert {row["domain"] for row in dataset.rows} == set(MIX)
    for row in dataset.rows:
        assert (row["completion"][0] == think) == (row["domain"] == "math")
    assert sum(row["teacher"][0] == think for row in dataset.rows) > len(dataset.rows) / 2
    batch = dataset.collate(list(range(len(dataset))))
    assert batch.teacher is not None
    for b in range(len(dataset)):
        student = batch.labels[b][batch.labels[b] != IGNORE].tolist()
        teacher = batch.teacher.labels[b][batch.teacher.labels[b] != IGNORE].tolist()
        assert student == teacher == dataset.rows[b]["completion"]


def test_sft_build_leaves_out_what_does_not_fit(tokenizer, tmp_path: Path) -> None:
    data = DataConfig(examples=6, mix={"tools": 1.0}, difficulties=[1])
    with pytest.raises(ValueError, match="no SFT example fits"):
        build_sft(data, "short", tokenizer, tmp_path / "sft.jsonl", seq_len=16)


def test_pretrain_windows_are_next_token_pairs(tokenizer, tmp_path: Path) -> None:
    data = DataConfig(examples=10, mix=MIX)
    path = build_pretrain(data, tokenizer, tmp_path / "tokens.npy")
    tokens = np.load(path)
    assert (tokens == tokenizer.raw.token_to_id(PAD_TOKEN)).sum() == 10  # one per document
    dataset = PretrainDataset(path, seq_len=32)
    batch = dataset.collate([0, 2])
    assert batch.input_ids[1].tolist() == tokens[64:96].tolist()
    assert batch.labels[1].tolist() == tokens[65:97].tolist()


def test_task_draws_are_prefix_stable_and_follow_the_mix() -> None:
    short = list(draw_tasks(DataConfig(examples=50, mix=MIX, seed=7)))
    long = list(draw_tasks(DataConfig(examples=400, mix=MIX, seed=7)))
    assert long[:50] == short
    counts = {name: sum(d == name for d, _, _ in long) for name in MIX}
    assert all(90 < c < 180 for c in counts.values()), counts


def test_sample_order_is_a_permutation_per_epoch() -> None:
    order = SampleOrder(10, seed=3)
    first = [order[k] for k in range(10)]
    second = [order[k] for k in range(10, 20)]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    assert [SampleOrder(10, seed=3)[k] for k in range(20)] == first + second


def test_stage_config_errors_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('stage = "sft"\n[train]\nstep = 3\n')
    with pytest.raises(ConfigError, match="step"):
        load_stage_config(bad)
    with pytest.raises(ConfigError, match="unknown domains"):
        load_stage_config(None, ['data.mix={"poetry" = 1.0}'], stage="sft", init="m")
    config = load_stage_config(None, ["train.steps=7", "style=short"], stage="sft", init="m")
    assert isinstance(config, SFTStage)
    assert config.train.steps == 7 and config.style == "short" and config.init == "m"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"stage": "sft"}, r"sft\.init\n  Field required"),
        ({"stage": "pretrain", "tokenizer": "t"}, r"pretrain\.shape\n  Field required"),
        ({"stage": "rl", "init": "m", "keep_layers": [0]}, r"rl\.keep_layers\n  Extra inputs"),
        ({"stage": "draft", "init": "m", "shape": {}, "qat": {}}, r"draft\.qat\n  Extra inputs"),
        ({"stage": "sft", "init": "m", "teacher": "t"}, "distils a think-style model"),
        ({"stage": "finetune"}, "does not match any of the expected tags"),
    ],
)
def test_each_stage_takes_its_own_fields_only(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_stage_config(None, **fields)


def test_data_built_in_threads_are_the_data_built_one_at_a_time(monkeypatch) -> None:
    data = DataConfig(examples=24, mix=MIX | {"code": 1.0}, natural=0.5, out_of_domain=0.1)
    threaded = list(chat_examples(data, "think")), list(pretrain_text(data))
    monkeypatch.setattr("training.data.datasets.BUILD_THREADS", 1)
    assert threaded == (list(chat_examples(data, "think")), list(pretrain_text(data)))


def test_in_order_keeps_order_and_runs_only_a_window_ahead_of_its_reader() -> None:
    started: list[int] = []
    lock = threading.Lock()

    def slow_first(i: int) -> int:
        with lock:
            started.append(i)
        time.sleep(0.2 if i == 0 else 0.0)
        return i * i

    assert list(in_order(slow_first, range(40))) == [i * i for i in range(40)]
    started.clear()
    results = in_order(slow_first, range(1000))
    assert next(results) == 0
    results.close()  # the reader stops: queued work is cancelled, not run
    assert len(started) <= 2 * BUILD_THREADS
