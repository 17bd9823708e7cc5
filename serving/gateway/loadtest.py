"""`tierserve loadtest`: Locust, headless, against a gateway, with a report and SLO checks.

Locust runs as its own process (`python -m locust`, which patches the standard library with
gevent, so it stays out of this one) on `serving/gateway/locustfile.py` and writes its CSVs; this
command reads them back into a report (a Markdown table and plots of throughput and TTFT
percentiles per tier over time) and exits 1 when an SLO is missed. With no --url it starts
`tierserve serve` and stops it afterwards. `--ramp` runs stages at rising user counts and
reports the saturation point; `--max-rss-growth` and `--check-kv-empty` watch the gateway
and tier processes through the run (the soak, `loadtests/soak.sh`).
"""

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from serving.gateway.loadtest_report import (
    TIERS,
    Summary,
    check_slos,
    plot_history,
    read_summary,
    report_markdown,
)
from serving.gateway.upstream import free_port

LOCUSTFILE = Path(__file__).with_name("locustfile.py")  # package data, found in a wheel too
KV_BLOCKS_METRIC = "tierserve_kv_cache_used_blocks"


class LoadTestError(RuntimeError):
    """The server could not be started or reached, or Locust failed to run."""


_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")


def parse_duration(text: str) -> int:
    """Seconds in Locust's --run-time format (`90`, `60s`, `5m`, `1h30m`), so that the
    durations people pass to `locust` work here too."""
    text = text.strip()
    match = _DURATION.fullmatch(text)
    if text.isdigit():
        total = int(text)
    elif text and match is not None:
        hours, minutes, seconds = (int(group or 0) for group in match.groups())
        total = hours * 3600 + minutes * 60 + seconds
    else:
        total = 0
    if total <= 0:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: seconds or Locust's format, e.g. 90, 60s, 5m, 1h30m"
        )
    return total


def start_server(config: Path | None, log_path: Path, timeout_s: float) -> tuple[
    subprocess.Popen, str
]:  # fmt: skip
    """`tierserve serve` on a free port, once every tier is ready (`wait_ready`)."""
    port = free_port()
    command = [sys.executable, "-c", "from serving.cli import main; main()", "serve"]
    command += ["--port", str(port)] + (["--config", str(config)] if config else [])
    process = subprocess.Popen(command, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s, process, log_path)
    except LoadTestError:
        process.terminate()
        process.wait(timeout=60)
        raise
    return process, url


def _tier_states(health: dict) -> str:
    tiers = health.get("tiers") or {}
    parts = []
    for tier, info in tiers.items():
        warmup = info.get("warmup") or {}
        progress = (
            f" {warmup.get('graphs_compiled')}/{warmup.get('graphs_wanted')}" if warmup else ""
        )
        parts.append(f"{tier} {info.get('state')}{progress}")
    return ", ".join(parts) or str(health.get("status"))


def wait_ready(
    url: str, timeout_s: float, process: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    """Until the gateway's /health answers 200 with every tier ready (`ok`): a load test of a
    server still compiling would measure its warm-up. LoadTestError after `timeout_s`,
    saying where each tier was."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    see = f"; see {log}" if log else ""
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise LoadTestError(
                f"the server exited with status {process.returncode} before its tiers were "
                f"ready{see}{_log_tail(log)}"
            )
        try:
            response = httpx.get(f"{url}/health", timeout=2)
            health = response.json()
            if response.status_code == 200 and health.get("status") == "ok":
                return
            last = _tier_states(health)
        except (httpx.HTTPError, ValueError) as e:
            last = type(e).__name__
        time.sleep(0.2)
    raise LoadTestError(
        f"{url}: tiers not ready after {timeout_s:g} s (--ready-timeout); last /health: {last}{see}"
    )


def _log_tail(log: Path | None, lines: int = 15) -> str:
    """The end of a server's log, for an error raised where the log may not outlive it (a
    benchmark's temporary directory)."""
    if log is None or not log.exists():
        return ""
    tail = log.read_text(errors="replace").splitlines()[-lines:]
    return "; its last lines:\n" + "\n".join(tail)


def server_pids(url: str) -> dict[str, int]:
    """The gateway's process and its embedded tiers', by name, from its /health."""
    health = httpx.get(f"{url}/health", timeout=5).json()
    pids = {tier: info["pid"] for tier, info in health["tiers"].items() if info.get("pid")}
    return {"gateway": health["pid"]} | pids


def kv_blocks_used(url: str) -> dict[str, float]:
    """Each tier's KV blocks held by live sequences, scraped through the gateway."""
    used = {}
    for tier in TIERS:
        text = httpx.get(f"{url}/metrics/tiers/{tier}", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == KV_BLOCKS_METRIC:
                    used[tier] = sample.value
    return used


def rss_mib(pids: dict[str, int]) -> dict[str, float]:
    return {tier: psutil.Process(pid).memory_info().rss / 2**20 for tier, pid in pids.items()}


def run_locust(url: str, users: int, spawn_rate: float, duration_s: int, prefix: Path) -> None:
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless"]
    command += ["--host", url, "-u", str(users), "-r", str(spawn_rate)]
    command += ["-t", f"{duration_s}s", "--stop-timeout", "30", "--exit-code-on-error", "0"]
    command += ["--csv", str(prefix), "--csv-full-history", "--only-summary", "-L", "WARNING"]
    with open(f"{prefix}_locust.log", "w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise LoadTestError(f"locust exited with {result.returncode}; see {prefix}_locust.log")


def one_run(args: argparse.Namespace, url: str, users: int, prefix: Path) -> Summary:
    """One Locust run at `users`, with the tier processes watched if asked."""
    watch = args.max_rss_growth is not None or args.check_kv_empty
    pids = server_pids(url) if watch else {}
    before = rss_mib(pids) if args.max_rss_growth is not None else {}
    run_locust(url, users, args.spawn_rate, args.duration, prefix)
    summary = read_summary(prefix, users, args.duration)
    if before:
        after = rss_mib(pids)
        summary.resources["rss_mib_start"] = {t: round(v, 1) for t, v in before.items()}
        summary.resources["rss_mib_end"] = {t: round(v, 1) for t, v in after.items()}
        summary.resources["rss_growth"] = {t: round(after[t] / before[t] - 1, 4) for t in after}
        summary.resources["pids_unchanged"] = server_pids(url) == pids
    if args.check_kv_empty:
        time.sleep(2)  # aborted streams free their blocks at the engine's next step
        summary.resources["kv_blocks_used_after"] = kv_blocks_used(url)
    return summary


def resource_failures(summary: Summary, max_rss_growth: float | None, kv: bool) -> list[str]:
    missed = []
    growth = summary.resources.get("rss_growth", {})
    assert isinstance(growth, dict)
    for tier, g in growth.items():
        if max_rss_growth is not None and g > max_rss_growth:
            missed.append(f"{tier} RSS grew {g:.1%} > {max_rss_growth:.0%}")
    if summary.resources.get("pids_unchanged") is False:
        missed.append("a process restarted during the run")
    used = summary.resources.get("kv_blocks_used_after", {})
    assert isinstance(used, dict)
    if kv and (set(used) != set(TIERS) or any(used.values())):
        missed.append(f"KV blocks not back to empty after the run: {used}")
    return missed


def saturation(stages: list[Summary], slo_ttft_p99_ms: float | None) -> tuple[Summary, str]:
    """The last stage before throughput stops rising (< 5% more requests/s), an SLO is
    missed or requests fail: the most users the service holds; and what ended the ramp."""
    best = stages[0]
    for stage in stages[1:]:
        if stage.failures:
            return best, f"requests failed at {stage.users} users"
        if check_slos(stage, slo_ttft_p99_ms, None):
            return best, f"the TTFT SLO was missed at {stage.users} users"
        if stage.requests_per_s < 1.05 * best.requests_per_s:
            return best, f"throughput stopped rising at {stage.users} users"
        best = stage
    return best, "not reached: throughput still rose at the last stage"


def run_loadtest(args: argparse.Namespace) -> None:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    server = None
    url = args.url
    if url is None:
        server, url = start_server(args.config, out / "serve.log", args.ready_timeout)
    else:
        wait_ready(url, args.ready_timeout)
    try:
        if args.ramp:
            stages = [one_run(args, url, u, out / f"ramp_{u}") for u in args.ramp]
            summary, why = saturation(stages, args.slo_ttft_p99_ms)
            (out / "ramp.json").write_text(json.dumps([asdict(s) for s in stages], indent=2))
            for s in stages:
                print(f"ramp: {s.users} users: {s.requests_per_s:.2f} req/s, "
                      f"{s.failures} failed, TTFT {s.ttft_ms}")  # fmt: skip
            print(f"saturation: {summary.users} users, {summary.requests_per_s:.2f} req/s ({why})")
            prefix = out / f"ramp_{summary.users}"
        else:
            prefix = out / "locust"
            summary = one_run(args, url, args.users, prefix)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=120)
    plot_history(prefix, out / "report.png")
    missed = check_slos(summary, args.slo_ttft_p99_ms, args.slo_error_rate)
    missed += resource_failures(summary, args.max_rss_growth, args.check_kv_empty)
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    report = report_markdown(summary, missed, "report.png")
    (out / "report.md").write_text(report)
    print(report, end="")
    print(f"report, CSVs and plot in {out}")
    if missed:
        print("SLO missed: " + "; ".join(missed), file=sys.stderr)
        sys.exit(1)


def add_loadtest(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "loadtest", help="run Locust headless against the gateway; report and check SLOs"
    )
    parser.add_argument("--users", type=int, default=8, help="concurrent Locust users")
    parser.add_argument("--spawn-rate", type=float, default=2.0, help="users started per second")
    parser.add_argument(
        "--duration",
        type=parse_duration,
        default=60,
        metavar="T",
        help="per ramp stage, as Locust's --run-time: 90 (seconds), 60s, 5m, 1h30m",
    )
    parser.add_argument("--url", help="the gateway (default: start `tierserve serve`)")
    parser.add_argument("--config", type=Path, help="the started server's config")
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds to wait for every tier to be ready (/health 200, status ok) first",
    )
    parser.add_argument("--out", type=Path, default=Path("loadtest-report"))
    parser.add_argument("--slo-ttft-p99-ms", type=float, default=10_000.0)
    parser.add_argument("--slo-error-rate", type=float, default=0.01)
    parser.add_argument(
        "--ramp", type=lambda s: [int(u) for u in s.split(",")], metavar="U1,U2,...",
        help="stages at these user counts; reports the saturation point",
    )  # fmt: skip
    parser.add_argument("--max-rss-growth", type=float, help="e.g. 0.10: tier RSS may grow 10%%")
    parser.add_argument(
        "--check-kv-empty", action="store_true", help="tiers' KV blocks must be free afterwards"
    )
    parser.set_defaults(run=run_loadtest)
