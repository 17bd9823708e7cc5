"""What ships as package data: a wheel built from this checkout, installed into an empty
directory, carries the locustfile (with its prompts), the chat template, the Grafana
dashboard and the CPU attention op's C++ source, and `tierserve loadtest`'s locustfile is
found inside the installed package, not in a source tree. The shipped prompts are the ones
the task registry writes now."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO

pytestmark = pytest.mark.slow

PROBE = """
import json, subprocess, sys
import serving
from kernels import cpu_extension
from serving.gateway.loadtest import LOCUSTFILE
listed = subprocess.run(
    [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--list"],
    capture_output=True, text=True, check=True,
).stdout
root = LOCUSTFILE.parents[1]
print(json.dumps({
    "serving": serving.__file__,
    "locustfile": str(LOCUSTFILE),
    "csrc": sorted(str(p) for p in cpu_extension.CSRC.iterdir()),
    "users": listed,
    "files": [str(p.relative_to(root)) for p in root.rglob("*") if p.suffix in (".json", ".jinja")],
}))
"""


def test_an_installed_wheel_load_tests_with_its_own_locustfile(tmp_path: Path) -> None:
    # Built from a copy: setuptools writes build/ beside the sources it builds.
    source, wheels, target = tmp_path / "source", tmp_path / "wheels", tmp_path / "site"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("serving", "router", "kernels", "speculative", "tasks", "training"):
        shutil.copytree(
            REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), str(source)], check=True)
    [wheel] = wheels.glob("tierserve-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True)
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tmp_path,  # not the checkout: nothing may come from the source tree
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(out.stdout)
    assert Path(found["serving"]).is_relative_to(target)
    assert Path(found["locustfile"]).is_relative_to(target)
    assert "TierserveUser" in found["users"]
    assert "gateway/dashboards/gateway.json" in set(found["files"])
    assert "model/chat_template.jinja" in found["files"]
    # The C++ ops' sources and the headers they share, which the installed package builds on
    # first use (one library, `ops.cpp` including the others).
    assert [Path(p).name for p in found["csrc"]] == [
        "dense_gemm.cpp",
        "fp4_gemm.cpp",
        "ops.cpp",
        "paged_attention.cpp",
        "row_products.h",
        "simd.h",
        "tensors.h",
    ]
    assert all(Path(p).is_relative_to(target) for p in found["csrc"])
