from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout: models/, loadtests/, training/recipes/
