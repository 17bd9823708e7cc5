"""Tokenized training sets, built once per run and read back by index.

A stage draws its tasks from the domains (`training.data.streams`), tokenizes them with the run's
tokenizer and writes them to disk; training then reads examples by position. Because the
order is a pure function of (seed, position), a resumed or multi-process run sees exactly the
examples an uninterrupted single-process run would, with no reader state to checkpoint.

- Pretraining: plain documents of both styles, each followed by `<|endoftext|>`, packed
  into one token array cut into `seq_len + 1` windows (`tokens.npy`).
- SFT: one example per assistant turn, the prompt rendered by the checkpoint's chat template
  with the generation prompt (as the server renders it) and the raw turn plus `<|im_end|>`
  as the completion; the loss covers the completion only (`sft.jsonl`).
"""

import json
import os
import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from tqdm import tqdm

from serving.model.tokenizer import Tokenizer
from tasks import DOMAINS, get_domain
from tasks.answers import split_reasoning
from tasks.base import Style
from training.config import DataConfig
from training.data.code_pieces import CodePieces
from training.data.copy_drills import copy_drill
from training.data.copy_text import copy_document
from training.data.natural import out_of_domain
from training.data.streams import pretrain_documents, sft_examples
from training.data.tokenizer import PAD_TOKEN

IGNORE = -100  # label of positions that carry no loss
# An example mostly waits on its reference's sandboxed runs (bash, python), so threads overlap
# the waits: 400 of the demo recipe's SFT examples took 35.0 and 34.6 s one at a time, 14.6 and
# 13.3 s in 8 threads (alternating, 2 cores, a two-thread training run beside them).
BUILD_THREADS = 8
T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L]
    labels: torch.Tensor  # [B, L]: the token to predict at each position, or IGNORE
    padding_mask: torch.Tensor  # [B, L] True on real tokens
    # SFT only: True where the label is a copy position (`copy_positions`), and each row's
    # domain, for the curriculum's copy-position and per-domain losses.
    copy_mask: torch.Tensor | None = None
    domains: list[str] | None = None
    # SFT with a teacher: the teacher's rows (its reasoning before the same answer), labelled
    # only on the answer, so its labelled positions line up with this batch's one to one.
    teacher: "Batch | None" = None

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.input_ids.shape[1]).expand_as(self.input_ids)

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE).sum())


def completion_batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    """(prompt, completion) token rows right-padded to the longest; position t predicts token
    t + 1, and only the completion's tokens are labels (SFT, DPO and RL all train so)."""
    width = max(len(prompt) + len(completion) for prompt, completion in rows) - 1
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, (prompt, completion) in enumerate(rows):
        ids = prompt + completion
        input_ids[b, : len(ids) - 1] = torch.tensor(ids[:-1], dtype=torch.long)
        labels[b, len(prompt) - 1 : len(ids) - 1] = torch.tensor(completion, dtype=torch.long)
        mask[b, : len(ids) - 1] = True
    return Batch(input_ids, labels, mask)


def draw_tasks(data: DataConfig) -> Iterator[tuple[str, int, int]]:
    """(domain, task seed, difficulty) of each example: the domain mix and difficulty drawn
    by a generator seeded per example, so any prefix of a longer run is the same."""
    names = list(data.mix)
    weights = [data.mix[n] for n in names]
    for i in range(data.examples):
        rng = random.Random(f"draw:{data.seed}:{i}")
        yield rng.choices(names, weights)[0], data.seed + i, rng.choice(data.difficulties)


def chat_examples(
    data: DataConfig, style: Style, codes: CodePieces | None = None
) -> Iterator[dict]:
    """The SFT conversations; a share `data.out_of_domain` of them are requests outside the
    domains, answered with what the tier can do, and a share `data.copy_drills` copy drills
    (which need `codes`). `codes`: see `sft_examples`."""
    if data.copy_drills and codes is None:
        raise ValueError("copy drills need the tokenizer's code pieces")
    domains = {name: get_domain(name) for name in data.mix}

    def example(drawn: tuple[int, tuple[str, int, int]]) -> dict:
        i, (name, seed, difficulty) = drawn
        kind = random.Random(f"ood:{data.seed}:{i}").random()
        if kind < data.out_of_domain:
            return out_of_domain(seed, style)
        if kind < data.out_of_domain + data.copy_drills:
            return copy_drill(seed, style, codes, data.natural)
        examples = sft_examples(domains[name], [seed], [difficulty], style, data.natural, codes)
        return next(examples)

    return in_order(example, enumerate(draw_tasks(data)))


def in_order(fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
    """fn over items in `BUILD_THREADS` threads, yielded in the items' order (the data stay
    a pure function of the config), never more than twice the threads ahead of the reader."""
    pool = ThreadPoolExecutor(BUILD_THREADS, thread_name_prefix="build")
    pending: deque = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * BUILD_THREADS:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(cancel_futures=True)


def write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def copy_positions(
    messages: list[dict], tools: list[dict] | None, completion: list[int], tokenizer: Tokenizer
) -> list[int]:
    """Completion positions whose token appears in the request (user and tool messages, the
    tool schemas) and holds a letter or digit: the values a model must copy (operands, names,
    arguments). Their loss is what the curriculum watches."""
    texts = [m["content"] for m in messages if m["role"] in ("user", "tool") and m.get("content")]
    texts += [json.dumps(tool, ensure_ascii=False) for tool in tools or []]
    source = {t for text in texts for t in tokenizer.encode(text)}
    return [
        j
        for j, t in enumerate(completion)
        if t in source and any(c.isalnum() for c in tokenizer.decode([t]))
    ]


def _short_style_reasons(domain: str) -> bool:
    return domain in DOMAINS and DOMAINS[domain].reasons("short")  # "other" has no domain


def build_sft(
    data: DataConfig,
    style: Style,
    tokenizer: Tokenizer,
    out: Path,
    seq_len: int,
    teacher: bool = False,
) -> Path:
    """Write `out` (JSONL: domain, difficulty, prompt ids, completion ids, copy positions);
    turns longer than `seq_len` are left out and counted on the progress bar.

    With `teacher` (the short style distilled from the think style), the examples are the
    think style's and each row also holds the teacher's completion: the whole think turn,
    whose answer, the short turn, is the row's completion (a short reference is the think
    reference without its reasoning; in a domain whose short style keeps its working, math,
    the student learns the whole think turn)."""
    eos = tokenizer.raw.token_to_id(tokenizer.eos_token)
    rows, skipped = [], 0
    source = "think" if teacher else style
    codes = CodePieces.of(tokenizer, data.merged_codes)
    examples = chat_examples(data, source, codes)
    bar = tqdm(examples, total=data.examples, desc=f"sft data ({style})")
    for example in bar:
        for messages, turn in example["turns"]:
            text = tokenizer.apply_chat_template(messages, tools=example.get("tools"))
            answer = turn
            if teacher and not _short_style_reasons(example["domain"]):
                answer = split_reasoning(turn)[1]
            prompt, completion = tokenizer.encode(text), [*tokenizer.encode(answer), eos]
            full = [*tokenizer.encode(turn), eos] if teacher else completion
            if len(prompt) + len(full) > seq_len + 1:
                skipped += 1
                bar.set_postfix(too_long=skipped)
                continue
            row = {
                "domain": example["domain"],
                "difficulty": example["difficulty"],
                "prompt": prompt,
                "completion": completion,
                "copy": copy_positions(messages, example.get("tools"), completion, tokenizer),
            }
            if teacher:  # a tokenization that differs at the seam: the answer alone
                row["teacher"] = full if full[-len(completion) :] == completion else completion
            rows.append(json.dumps(row) + "\n")
    if not rows:
        raise ValueError(f"no SFT example fits seq_len={seq_len}")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, lambda f: f.write("".join(rows).encode()))
    return out


def pretrain_text(data: DataConfig) -> Iterator[str]:
    """Documents without chat markup, half of them in each style; a share `data.copy_docs`
    are copy exercises instead (`training.data.copy_text`), and a domain with drills of its
    own (`Domain.drill`) gives those in place of its solved tasks."""
    domains = {name: get_domain(name) for name in data.mix}

    def document(drawn: tuple[int, tuple[str, int, int]]) -> str:
        i, (name, seed, difficulty) = drawn
        if random.Random(f"copydoc:{data.seed}:{i}").random() < data.copy_docs:
            return copy_document(seed)
        drill = domains[name].drill(seed, difficulty)
        if drill is not None:
            return drill
        style = "think" if random.Random(f"style:{data.seed}:{i}").random() < 0.5 else "short"
        return next(pretrain_documents(domains[name], [seed], [difficulty], style))

    return in_order(document, enumerate(draw_tasks(data)))


def build_pretrain(data: DataConfig, tokenizer: Tokenizer, out: Path) -> Path:
    """Write `out` (`.npy`, int32): the documents, each ended by `<|endoftext|>`."""
    eod = tokenizer.raw.token_to_id(PAD_TOKEN)
    ids: list[int] = []
    for doc in tqdm(pretrain_text(data), total=data.examples, desc="pretrain data"):
        ids += [*tokenizer.encode(doc), eod]
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, lambda f: np.save(f, np.asarray(ids, dtype=np.int32)))
    return out


class SampleOrder:
    """Position k of the training stream -> example index: a fresh seeded permutation of the
    dataset per epoch, so every example is seen once per epoch in a random order."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def __getitem__(self, k: int) -> int:
        epoch, offset = divmod(k, self.size)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.size, generator=g)
        return int(self._perm[offset])


class PretrainDataset:
    def __init__(self, path: Path, seq_len: int) -> None:
        self.tokens = torch.from_numpy(np.load(path)).long()
        self.seq_len = seq_len
        if len(self) < 1:
            raise ValueError(f"{path}: fewer than {seq_len + 1} tokens")

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def length(self, index: int) -> int:
        return self.seq_len

    def collate(self, indices: list[int]) -> Batch:
        windows = torch.stack(
            [self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1] for i in indices]
        )
        inputs = windows[:, :-1]
        return Batch(inputs, windows[:, 1:].clone(), torch.ones_like(inputs, dtype=torch.bool))


class SFTDataset:
    def __init__(self, path: Path, pad_id: int) -> None:
        self.rows = [json.loads(line) for line in path.read_text().splitlines()]
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.rows)

    def domain(self, index: int) -> str:
        return self.rows[index]["domain"]

    def length(self, index: int) -> int:
        row = self.rows[index]
        return len(row["prompt"]) + len(row["completion"])

    def collate(self, indices: list[int]) -> Batch:
        """Right-padded to the longest example; labels only on completion tokens."""
        rows = [self.rows[i] for i in indices]
        batch = completion_batch([(r["prompt"], r["completion"]) for r in rows], self.pad_id)
        batch.copy_mask = torch.zeros_like(batch.padding_mask)
        for b, row in enumerate(rows):
            offset = len(row["prompt"]) - 1
            batch.copy_mask[b, [offset + j for j in row.get("copy", [])]] = True
        batch.domains = [row["domain"] for row in rows]
        if "teacher" in rows[0]:
            teacher = completion_batch([(r["prompt"], r["teacher"]) for r in rows], self.pad_id)
            for b, row in enumerate(rows):  # the reasoning is context, not a target
                reasoning = len(row["teacher"]) - len(row["completion"])
                teacher.labels[b, : len(row["prompt"]) - 1 + reasoning] = IGNORE
            batch.teacher = teacher
        return batch
