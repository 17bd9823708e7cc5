"""Run untrusted Python or bash: namespaces via bubblewrap, rlimits, timeout, capped output."""

from training.tasks.sandbox.process import Limits, SandboxResult
from training.tasks.sandbox.sandbox import Sandbox, SandboxPool, bwrap_available, run_code

__all__ = ["Limits", "Sandbox", "SandboxPool", "SandboxResult", "bwrap_available", "run_code"]
