"""A load test's report: Locust's CSVs read back into a summary per tier, the SLO checks,
the Markdown report and the plot of throughput and TTFT percentiles over time."""

import csv
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

TIERS = ("full", "highspeed")


@dataclass
class Summary:
    users: int
    duration_s: float
    requests: int
    failures: int
    requests_per_s: float
    ttft_ms: dict[str, dict[str, float]]  # tier -> {"p50", "p99"}
    requests_by_tier: dict[str, int]
    errors: dict[str, int]  # error message -> occurrences
    resources: dict[str, object] = field(default_factory=dict)

    @property
    def error_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0


def _tier_of(name: str) -> str:
    """The tier in a request's name, `chat stream [full]`."""
    return name.rsplit("[", 1)[-1].rstrip("]") if name.endswith("]") else "none"


def read_summary(prefix: Path, users: int, duration_s: float) -> Summary:
    """The run's figures from Locust's CSVs (`{prefix}_stats.csv`, `_failures.csv`)."""
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    requests = [r for r in rows if r["Type"] == "POST"]
    ttft = {
        r["Name"]: {"p50": float(r["50%"]), "p99": float(r["99%"]), "n": int(r["Request Count"])}
        for r in rows
        if r["Type"] == "TTFT" and int(r["Request Count"])
    }
    by_tier: dict[str, int] = defaultdict(int)
    for r in requests:
        by_tier[_tier_of(r["Name"])] += int(r["Request Count"])
    with open(f"{prefix}_failures.csv", newline="") as f:
        errors: dict[str, int] = defaultdict(int)
        for r in csv.DictReader(f):
            errors[r["Error"]] += int(r["Occurrences"])
    total = sum(int(r["Request Count"]) for r in requests)
    return Summary(
        users=users,
        duration_s=duration_s,
        requests=total,
        failures=sum(int(r["Failure Count"]) for r in requests),
        requests_per_s=total / duration_s,
        ttft_ms=ttft,
        requests_by_tier=dict(by_tier),
        errors=dict(errors),
    )


def plot_history(prefix: Path, out: Path) -> None:
    """Throughput and TTFT p50/p99 per tier over time, from Locust's full history."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    with open(f"{prefix}_stats_history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    t0 = min((int(r["Timestamp"]) for r in rows), default=0)
    for r in rows:
        t = int(r["Timestamp"]) - t0
        if r["Type"] == "POST":
            series[("rps", _tier_of(r["Name"]))].append((t, float(r["Requests/s"])))
        elif r["Type"] == "TTFT" and r["99%"] != "N/A":
            series[("p50", r["Name"])].append((t, float(r["50%"])))
            series[("p99", r["Name"])].append((t, float(r["99%"])))
    fig, (ax_rps, ax_ttft) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for tier in sorted({tier for (_, tier) in series}):
        per_second: dict[float, float] = defaultdict(float)
        for t, value in series[("rps", tier)]:
            per_second[t] += value  # the request kinds of one tier add up
        if per_second:
            ax_rps.plot(*zip(*sorted(per_second.items()), strict=True), label=tier)
        for q, style in (("p50", "-"), ("p99", "--")):
            if series[(q, tier)]:
                ax_ttft.plot(*zip(*series[(q, tier)], strict=True), style, label=f"{tier} {q}")
    ax_rps.set_ylabel("requests/s")
    ax_ttft.set_ylabel("TTFT ms")
    ax_ttft.set_xlabel("seconds")
    for ax in (ax_rps, ax_ttft):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle("tierserve load test: throughput and time to first token per tier")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def check_slos(summary: Summary, ttft_p99_ms: float | None, error_rate: float | None) -> list[str]:
    """The SLOs missed, each as a sentence."""
    missed = []
    if ttft_p99_ms is not None:
        for tier, q in sorted(summary.ttft_ms.items()):
            if q["p99"] > ttft_p99_ms:
                missed.append(f"p99 TTFT on {tier} is {q['p99']:.0f} ms > {ttft_p99_ms:g} ms")
    if error_rate is not None and summary.error_rate > error_rate:
        missed.append(f"error rate {summary.error_rate:.2%} > {error_rate:.2%}")
    return missed


def report_markdown(summary: Summary, missed: list[str], plot: str | None) -> str:
    lines = [
        f"# Load test: {summary.users} users, {summary.duration_s:g} s",
        "",
        f"{summary.requests} requests, {summary.requests_per_s:.2f} requests/s, "
        f"{summary.failures} failed ({summary.error_rate:.2%})",
        "",
        "| tier | requests | streams with a first token | TTFT p50 ms | TTFT p99 ms |",
        "|---|---|---|---|---|",
    ]
    for tier in sorted(set(summary.requests_by_tier) | set(summary.ttft_ms)):
        q = summary.ttft_ms.get(tier, {})
        lines.append(
            f"| {tier} | {summary.requests_by_tier.get(tier, 0)} | {int(q.get('n', 0))} | "
            f"{q.get('p50', math.nan):.0f} | {q.get('p99', math.nan):.0f} |"
        )
    lines += ["", "Errors by type:", ""]
    lines += [f"- {n} × {error}" for error, n in sorted(summary.errors.items())] or ["- none"]
    if summary.resources:
        lines += ["", "Tier resources: `" + json.dumps(summary.resources) + "`"]
    lines += ["", "SLOs: " + ("; ".join(missed) if missed else "all met")]
    if plot:
        lines += ["", f"![throughput and TTFT per tier]({plot})"]
    return "\n".join(lines) + "\n"
