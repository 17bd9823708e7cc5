"""Training curves as a PNG: the loss terms and learning rate per step, held-out completion
rates at each evaluation."""

from math import nan
from pathlib import Path

LOSS_TERMS = ("loss", "ce", "copy_loss", "mtp_loss", "aux_loss", "z_loss")
HELDOUT_LOSSES = ("copy_loss",)  # eval keys that are losses, not completion rates


def plot_curves(log: list[dict], evals: list[dict], out: Path, title: str) -> None:
    if not log:
        return
    import matplotlib  # the `train` extra; imported here so the tokenizer needs none of it

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    panels = 3 if evals else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.6))
    steps = [row["step"] for row in log]
    for term in LOSS_TERMS:
        if term in log[0]:
            values = [nan if row[term] is None else row[term] for row in log]
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
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
