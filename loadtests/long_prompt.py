"""A prompt of a hundred thousand tokens through `tierserve engine --max-model-len 131072` on a
hybrid (Qwen3-Next) checkpoint: whether it is served, in how long, and the server's peak
resident memory against what the checkpoint and its cache take.

The checkpoint is random (transformers' `Qwen3NextForCausalLM` at `--hidden` and `--layers`,
three Gated DeltaNet layers to one full-attention layer), with the demo models' tokenizer: what
is measured is that the engine holds the context, not what the model answers. The prompt goes
as token ids, prefilled in chunks of `--max-num-batched-tokens`.

    python -m loadtests.long_prompt [--tokens 100000] [--hidden 256] [--layers 8]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from serving.gateway.loadtest import wait_ready
from serving.gateway.upstream import free_port

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "models" / "demo-full"
MAX_MODEL_LEN = 131072


def build_checkpoint(path: Path, hidden: int, layers: int) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    heads = hidden // 64
    config = transformers.Qwen3NextConfig(
        vocab_size=2746,  # the demo tokenizer's
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=64,
        linear_num_key_heads=heads,
        linear_num_value_heads=2 * heads,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=MAX_MODEL_LEN,
    )
    transformers.Qwen3NextForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER / name, path / name)
    return path


class PeakMemory(threading.Thread):
    """The server's peak resident set (VmHWM), read until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.stop, self.peak_kib = pid, threading.Event(), 0

    def run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_kib = max(self.peak_kib, int(line.split()[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_checkpoint(Path(tmp) / "hybrid", args.hidden, args.layers)
        weights = (checkpoint / "model.safetensors").stat().st_size
        port = free_port()
        command = [sys.executable, "-c", "from serving.cli import main; main()", "engine"]
        command += ["--model", str(checkpoint), "--port", str(port), "--dtype", "float32"]
        command += ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "1"]
        command += ["--served-model-name", "long"]
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        log = Path(tmp) / "engine.log"
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        with log.open("w") as out:
            server = subprocess.Popen(command, stdout=out, stderr=out, env=env)
        root = f"http://127.0.0.1:{port}"
        memory = PeakMemory(server.pid)
        try:
            wait_ready(root, 600, server, log)
            memory.start()
            prompt = [(i * 7919) % 2000 + 10 for i in range(args.tokens)]
            body = {"model": "long", "prompt": prompt, "max_tokens": 8,
                    "temperature": 0.0, "ignore_eos": True}  # fmt: skip
            start = time.monotonic()
            response = httpx.post(f"{root}/v1/completions", json=body, timeout=3600)
            seconds = time.monotonic() - start
            memory.stop.set()
            memory.join()
        finally:
            server.terminate()
            server.wait(60)
        if response.status_code != 200:
            print(log.read_text()[-3000:])
            raise SystemExit(f"HTTP {response.status_code}: {response.text[:500]}")
        usage = response.json()["usage"]
        print(
            f"hybrid checkpoint: hidden {args.hidden}, {args.layers} layers, "
            f"{weights / 2**20:.0f} MiB of weights; --max-model-len {MAX_MODEL_LEN}\n"
            f"prompt {usage['prompt_tokens']} tokens, {usage['completion_tokens']} generated: "
            f"HTTP 200 in {seconds:.1f} s ({usage['prompt_tokens'] / seconds:.0f} prompt tok/s); "
            f"server peak resident memory {memory.peak_kib / 2**20:.2f} GiB"
        )


if __name__ == "__main__":
    main()
