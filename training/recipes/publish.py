"""The recipe's models in the shipped layout: each tier a Hugging Face directory with the
recipe's recommended sampling and a card that says how it was made (the command, and every
run of the chain with its steps), its size and its held-out tables."""

import json
import shutil
from pathlib import Path

from serving.model.checkpoint import load_checkpoint


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def recommend_sampling(model_dir: Path, settings: dict[str, float | int]) -> None:
    """Add the recipe's recommended sampling settings to generation_config.json, which the
    engine applies to requests that leave them unset (`--generation-config auto`)."""
    path = model_dir / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | settings, indent=2) + "\n")


def card(model_dir: Path, title: str, how: str, chain: str, table: str, command: str) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    params = sum(
        p.numel() for p in load_checkpoint(model_dir, keep_fp4=False).parameters()
    )  # tied: once
    return (
        f"# {title}\n\n{how}\n\n"
        f"- architecture: `{config['architectures'][0]}`, {params / 1e6:.2f}M parameters, "
        f"stored in {config['dtype']} ({size_mb(model_dir):.1f} MB)\n"
        f"- made by: `{command}`\n\n"
        f"## The runs that made it\n\n{chain}\n\n"
        f"## Held-out evaluation\n\n{table}\n"
    )


def publish(
    model_dir: Path,
    target: Path,
    sampling: dict[str, float | int],
    title: str,
    how: str,
    chain: str,
    table: str,
    command: str,
) -> None:
    """Copy `model_dir` to `target` (replacing it) with the sampling settings and its card."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(model_dir, target)
    recommend_sampling(target, sampling)
    (target / "README.md").write_text(card(target, title, how, chain, table, command))
