"""Decode graphs compiled apart (`serving/engine/compile_process.py`): a server's engine is
ready once its one-row graph is in, a process of its own compiles the larger sizes into the
whole-graph store, and the engine loads them without tracing them itself; a process that
stores nothing leaves those steps in chunks of the one-row graph, with the same tokens."""

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch._dynamo.utils import counters

from loadtests.bench_speculative import task_prompts
from serving.engine.compile_process import CompileApart
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import load_checkpoint
from serving.sampling.params import SamplingParams
from speculative.config import SpeculativeConfig
from tests import REPO
from tests.serving.gateway.processes import alive, settles, state
from tests.tiny_models import TINY_MOE, prompts, save_tiny_moe

# max_num_seqs 2: graphs of 1 and 2 rows (`graph_sizes`).
CONFIG = dict(max_num_seqs=2, max_num_batched_tokens=64)
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
MTP_TARGET = REPO / "models" / "demo-highspeed"  # a trained target with an MTP layer


def eager_tokens(ckpt: Path, ps: list[list[int]]) -> list[list[int]]:
    eager = LLMEngine(load_checkpoint(ckpt), EngineConfig(**CONFIG), eos_token_ids=[])
    return [o[0].token_ids for o in eager.generate(ps, PARAMS)]


@pytest.mark.slow
def test_larger_graphs_and_the_drafters_compile_in_a_process_of_their_own(tmp_path, monkeypatch):
    """A speculating engine (MTP) is ready at one row while the process compiles the
    target's verify size and the drafter's graphs (it drafts once they are in); it loads them
    whole, without tracing, and serves plain decoding's greedy tokens through them."""
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    config = EngineConfig(
        max_num_seqs=1,  # the target's graphs: 1 row, and a verify step's 5
        speculative=SpeculativeConfig(method="mtp"),
        dtype="float32",
        enforce_eager=False,
        compile_graphs_apart=True,
    )
    engine = LLMEngine.from_checkpoint(MTP_TARGET, config)
    target = engine.runner.paged.graphs
    deadline = time.monotonic() + 300
    while not target.ready and time.monotonic() < deadline:
        time.sleep(0.05)
    # Ready at one row, while the other process still imports torch and compiles; the
    # drafter's graphs are not in yet, so the engine decodes without drafts meanwhile.
    assert target.progress() == (1, 2, True, False)
    assert engine.warmup().ready and not engine.warmup().done
    assert not engine.speculator.proposer.ready()
    frames = counters["frames"]["total"]  # the one-row target graph, traced here
    engine.wait_warm()
    assert engine.warmup() == (4, 4, True, True)
    assert target.ready_sizes == (1, 5)
    assert counters["frames"]["total"] == frames  # the rest loaded whole
    assert len(list((tmp_path / "cache" / "graphs").iterdir())) == 4
    ps = task_prompts(engine.tokenizer, 2)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = LLMEngine.from_checkpoint(MTP_TARGET, EngineConfig(dtype="float32"))
    rows = []
    call = target._call
    target._call = lambda inputs: (rows.append(len(inputs.ids)), call(inputs))[1]
    got = [o[0].token_ids for o in engine.generate(ps, params)]
    assert got == [o[0].token_ids for o in plain.generate(ps, params)]
    assert 5 in rows  # verify steps went through the loaded graph


@pytest.mark.slow
def test_a_compile_process_that_stores_nothing_leaves_steps_in_chunks(
    tmp_path: Path, monkeypatch, caplog
):
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = save_tiny_moe(tmp_path / "tiny-moe")
    engine = LLMEngine(
        load_checkpoint(ckpt),
        EngineConfig(**CONFIG, enforce_eager=False),
        eos_token_ids=[],
        compile_apart=CompileApart(
            lambda: subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        ),
    )
    graphs = engine.runner.paged.graphs
    with caplog.at_level(logging.WARNING, logger="serving.model.graphs.decode"):
        graphs.wait()
    assert "no decode graph of 2 rows was stored (compile process exit status 3)" in caplog.text
    assert engine.warmup() == (1, 2, True, True)
    rows = []
    call = graphs._call
    graphs._call = lambda inputs: (rows.append(len(inputs.ids)), call(inputs))[1]
    ps = prompts(2, TINY_MOE["vocab_size"], seed=7)
    assert [o[0].token_ids for o in engine.generate(ps, PARAMS)] == eager_tokens(ckpt, ps)
    assert set(rows) == {1}


def stand_in(tmp_path: Path) -> tuple[CompileApart, list[int]]:
    """A stand-in for the compile process, started: in a group of its own, with a compiler
    of its own. Returns it and the pids of both."""
    child = tmp_path / "child"
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '60'])\n"
        f"open({str(child)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    apart = CompileApart(lambda: subprocess.Popen([sys.executable, "-c", script], process_group=0))
    process = apart()
    assert settles(lambda: child.exists() and child.read_text())
    return apart, [process.pid, int(child.read_text())]


def test_hold_stops_the_compile_process_and_its_compilers_and_continues_them(tmp_path: Path):
    apart, pids = stand_in(tmp_path)
    process = apart.process
    assert process is not None
    try:
        apart.hold(True)
        assert settles(lambda: all(state(pid) == "T" for pid in pids))
        apart.hold(False)
        assert settles(lambda: all(state(pid) != "T" for pid in pids))
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.mark.parametrize("held", [False, True])
def test_stop_ends_the_compile_process_and_its_compilers(tmp_path: Path, held: bool):
    """A server that stops ends its compile process, held or not, before it exits."""
    apart, pids = stand_in(tmp_path)
    apart.hold(held)
    apart.stop()
    assert apart.process is not None and apart.process.returncode == -signal.SIGKILL
    assert settles(lambda: not any(alive(pid) for pid in pids))
    apart.stop()  # a second stop, as after a process that ended by itself: nothing to do


def test_a_held_compile_process_ends_when_its_server_is_killed(tmp_path: Path):
    """The stopped group is orphaned when its server dies, and the kernel's SIGHUP ends it:
    no stopped process is left behind."""
    held = tmp_path / "held"
    server = (
        "import signal, subprocess, time\n"
        "from serving.engine.compile_process import CompileApart\n"
        # SIGHUP's default action, as a shell's job has it, also under nohup (which leaves
        # SIGHUP ignored, so the orphaned group's SIGHUP would not end it)
        "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
        "apart = CompileApart(lambda: subprocess.Popen(['sleep', '600'], process_group=0))\n"
        "apart.hold(True)\n"
        "process = apart()\n"
        f"open({str(held)!r}, 'w').write(str(process.pid))\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", server], start_new_session=True)
    try:
        assert settles(lambda: held.exists() and held.read_text(), 60)
        pid = int(held.read_text())
        assert settles(lambda: state(pid) == "T")
    finally:
        parent.kill()
        parent.wait()
    assert settles(lambda: not alive(pid))


class RecordedCompileApart(CompileApart):
    def __init__(self) -> None:
        super().__init__(lambda: subprocess.Popen(["true"]))
        self.signals: list[int] = []

    def _signal(self, sig: int) -> None:
        self.signals.append(sig)


def test_the_engine_holds_its_compile_process_while_it_serves_a_lone_stream(tmp_path: Path):
    ckpt = save_tiny_moe(tmp_path / "tiny-moe")
    apart = RecordedCompileApart()
    engine = LLMEngine(load_checkpoint(ckpt), EngineConfig(**CONFIG), eos_token_ids=[],
                       compile_apart=apart)  # fmt: skip
    ps = prompts(2, TINY_MOE["vocab_size"], seed=7)
    engine.generate(ps[:1], PARAMS)  # one stream, then nothing to run
    assert apart.signals == [signal.SIGSTOP, signal.SIGCONT]
    engine.generate(ps, PARAMS)  # two streams: the larger graphs are for them
    assert apart.signals == [signal.SIGSTOP, signal.SIGCONT]
