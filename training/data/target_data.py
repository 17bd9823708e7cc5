"""Drafter data from the target's own outputs.

A drafter is asked, when serving, to guess what the target writes, not what the reference
traces say: the highspeed student, for one, drifts from its references where it errs or
words an answer its own way. So the draft stage can replace each reference completion by the
target's greedy continuation of the same prompt (`draft_data = "target"`), generated through
our engine, and distil the target's distributions along it.
"""

import json
from pathlib import Path

from tqdm import tqdm

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.sampling.params import SamplingParams
from training.data.datasets import write_atomic


def target_completions(rows: Path, out: Path, target_dir: str, seq_len: int) -> Path:
    """`rows` (build_sft's JSONL) with every completion the target's greedy one, within
    `seq_len` (its EOS kept when it stopped); written to `out` atomically."""
    examples = [json.loads(line) for line in rows.read_text().splitlines()]
    config = EngineConfig(max_num_seqs=32, enforce_eager=True)  # one pass: compiling costs more
    engine = LLMEngine.from_checkpoint(target_dir, config)
    generated: list[list[int]] = [[] for _ in examples]
    for i, row in enumerate(examples):
        params = SamplingParams(temperature=0.0, max_tokens=seq_len + 1 - len(row["prompt"]))
        engine.add_request(str(i), row["prompt"], params)
    with tqdm(total=len(examples), desc="target completions") as bar:
        while engine.has_unfinished():
            for output in engine.step():
                for delta in output.outputs:
                    generated[int(output.request_id)] += delta.token_ids
                bar.update(int(output.finished))
    # Copy positions index the reference completion: none are kept.
    lines = [
        json.dumps(row | {"completion": completion, "copy": []}) + "\n"
        for row, completion in zip(examples, generated, strict=True)
    ]
    write_atomic(out, lambda f: f.write("".join(lines).encode()))
    return out
