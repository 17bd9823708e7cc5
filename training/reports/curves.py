"""Training curves as a PNG: the loss terms and learning rate per step, held-out completion
rates at each evaluation, and for RL the training reward per domain (and the share of answers
with a located false step, where the stage looks for them) beside the diagnostics
that say whether the update follows the reward (importance ratio, clipping, KL, entropy,
advantage spread, groups without reward variance)."""

from collections.abc import Sequence
from math import nan
from pathlib import Path

LOSS_TERMS = ("loss", "ce", "copy_loss", "mtp_loss", "aux_loss", "z_loss")
HELDOUT_LOSSES = ("copy_loss",)  # eval keys that are losses, not completion rates
RL_DIAGNOSTICS = (
    "ratio_max_dev",
    "ratio_std",
    "clip_frac",
    "kl",
    "entropy",
    "adv_std",
    "zero_variance_groups",
)


def plot_curves(
    log: list[dict],
    evals: list[dict],
    out: Path,
    title: str,
    boundaries: Sequence[tuple[int, str]] = (),
) -> None:
    """`boundaries`: (first step, name) of each run a stage chains (its phases), drawn as
    vertical lines, so a jump at a phase's start reads as the new data or settings."""
    if not log:
        return
    import matplotlib  # the `train` extra; imported here so the tokenizer needs none of it

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    rl = any(key.startswith("reward/") for row in log for key in row)
    panels = 2 + bool(evals) + 2 * rl
    width = 5 * panels
    fig, axes = plt.subplots(1, panels, figsize=(width, 3.6))
    # Margins fixed in inches rather than `tight_layout`, which measured every label and took
    # as long as the drawing itself: a short run draws its curves at every stage's end.
    fig.subplots_adjust(left=0.9 / width, right=1 - 0.2 / width, bottom=0.14, top=0.9, wspace=0.3)
    steps = [row["step"] for row in log]
    for term in LOSS_TERMS:
        if any(term in row for row in log):  # phases of several kinds log different terms
            values = [nan if row.get(term) is None else row[term] for row in log]
            axes[0].plot(steps, values, label=term, linewidth=1)
    for key in HELDOUT_LOSSES:
        points = [(row["step"], row[key]) for row in evals if key in row]
        if points:
            axes[0].plot(*zip(*points, strict=True), "ko", label=f"held-out {key}")
    axes[0].set(xlabel="step", ylabel="loss", title=title, yscale="log")
    axes[0].legend(fontsize=7)
    axes[1].plot(steps, [row["lr"] for row in log], color="tab:gray")
    axes[1].set(xlabel="step", ylabel="learning rate")
    if evals:
        for key in sorted({k for row in evals for k in row} - {"step", *HELDOUT_LOSSES}):
            points = [(row["step"], row[key]) for row in evals if key in row]
            axes[2].plot(*zip(*points, strict=True), marker="o", label=key)
        axes[2].set(xlabel="step", ylabel="held-out completion rate", ylim=(-0.02, 1.02))
        axes[2].legend(fontsize=7)
    if rl:
        _plot_rl(axes[-2], axes[-1], steps, log)
    for start, name in boundaries:
        for axis in axes:
            axis.axvline(start, color="tab:gray", linewidth=0.5, linestyle=":")
        axes[1].annotate(
            name, (start, 0), xycoords=("data", "axes fraction"), fontsize=6, rotation=90
        )
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _plot_rl(rewards, diagnostics, steps: list[int], log: list[dict]) -> None:
    for prefix, style in (("reward/", "-"), ("false_step/", "--")):
        for key in sorted({k for row in log for k in row if k.startswith(prefix)}):
            values = [row.get(key, nan) for row in log]
            rewards.plot(steps, values, style, label=key, linewidth=1)
    rewards.set(xlabel="step", ylabel="training reward, false-step share")
    rewards.legend(fontsize=7)
    for key in RL_DIAGNOSTICS:
        if any(key in row for row in log):
            values = [max(row.get(key, nan), 1e-8) for row in log]  # a log axis: 0 drawn at 1e-8
            diagnostics.plot(steps, values, label=key, linewidth=1)
    diagnostics.set(xlabel="step", ylabel="RL diagnostics", yscale="log")
    diagnostics.legend(fontsize=7)
