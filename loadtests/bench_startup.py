"""How long `tierserve engine` takes to start: to /health 200, and until its compiled decode
steps are ready (`serving/model/decode_graphs.py`: they compile in the background while the
server answers eagerly), with a cold compile cache and then a warm one, and with
`--enforce-eager` for reference.

    python -m loadtests.bench_startup [--checkpoint DIR] [--dtype float32]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtests.bench_engine import build_checkpoint
from serving.gateway.upstream import free_port

READY = re.compile(r"compiled decode steps for batch sizes .* in ([0-9.]+) s")


def start(checkpoint: Path, cache: Path, extra: list[str], log: Path) -> tuple[float, float | None]:
    """Seconds from spawn to /health 200, and to compiled steps (None with --enforce-eager)."""
    port = free_port()
    command = [sys.executable, "-c", "from serving.cli import main; main()", "engine"]
    command += ["--model", str(checkpoint), "--port", str(port), *extra]
    env = dict(os.environ, TIERSERVE_CACHE_DIR=str(cache), OMP_NUM_THREADS="2")
    begin = time.monotonic()
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=out, env=env)
    try:
        while True:
            assert server.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        health = time.monotonic() - begin
        if "--enforce-eager" in extra:
            return health, None
        while not READY.search(log.read_text()):
            assert server.poll() is None, log.read_text()[-2000:]
            time.sleep(0.1)
        return health, time.monotonic() - begin
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/tierserve-bench-moe-43m"))
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    checkpoint = build_checkpoint(args.checkpoint)
    extra = ["--dtype", args.dtype]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache, log = Path(tmp) / "cache", Path(tmp) / "engine.log"
        eager = [*extra, "--enforce-eager"]
        rows.append(("--enforce-eager", *start(checkpoint, cache, eager, log)))
        rows.append(("compiled, cold cache", *start(checkpoint, cache, extra, log)))
        rows.append(("compiled, warm cache", *start(checkpoint, cache, extra, log)))
    print(f"\n`tierserve engine --model {checkpoint.name} --dtype {args.dtype}`, 2 threads")
    print("| start | to /health 200 s | to compiled decode steps s |\n|---|---|---|")
    for name, health, ready in rows:
        print(f"| {name} | {health:.1f} | {'-' if ready is None else f'{ready:.1f}'} |")


if __name__ == "__main__":
    main()
