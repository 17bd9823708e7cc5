"""Drafter data from the target's own outputs: each completion is what the target writes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import load_checkpoint
from serving.sampling.params import SamplingParams
from training.data.target_data import target_completions


def test_completions_are_the_targets_greedy_ones(random_checkpoint: Path, tmp_path: Path) -> None:
    engine = LLMEngine.from_checkpoint(random_checkpoint, EngineConfig(enforce_eager=True))
    tok = engine.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        for text in ("What is 2 + 3?", "List the files.", "Weather in Oslo?")
    ]
    rows = tmp_path / "rows.jsonl"
    lines = [
        json.dumps({"domain": "math", "difficulty": 1, "prompt": p, "completion": [5], "copy": [0]})
        for p in prompts
    ]
    rows.write_text("\n".join(lines) + "\n")
    seq_len = max(map(len, prompts)) + 12
    out = target_completions(rows, tmp_path / "target.jsonl", str(random_checkpoint), seq_len)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    for prompt, row in zip(prompts, written, strict=True):
        budget = seq_len + 1 - len(prompt)
        expected = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=budget))
        assert row["prompt"] == prompt
        assert row["completion"] == expected[0][0].token_ids
        assert len(prompt) + len(row["completion"]) <= seq_len + 1
        assert row["copy"] == []


@pytest.mark.slow
def test_a_draft_stage_distils_on_the_targets_outputs(
    random_checkpoint: Path, tmp_path: Path
) -> None:
    sets = ["data.examples=6", "train.steps=2", "train.micro_batch=2", "train.seq_len=512"]
    sets += ["train.eval_n=1", "train.eval_max_tokens=8", 'draft_data="target"']
    shape = (
        "architectures=['Qwen3ForCausalLM'], hidden_size=32, intermediate_size=64, "
        "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16"
    )
    sets.append(f"shape={{{shape}}}")
    cmd = [sys.executable, "-c", "from serving.cli import main; main()", "train", "draft"]
    cmd += ["--init", str(random_checkpoint), "--style", "short", "--out", str(tmp_path / "run")]
    cmd += [f"--set={s}" for s in sets]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    data = tmp_path / "run" / "data"
    assert (data / "sft-short-target.jsonl").exists()
    assert load_checkpoint(tmp_path / "run" / "model").config.architecture == "Qwen3ForCausalLM"
