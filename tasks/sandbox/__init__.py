"""Run untrusted Python or bash: namespaces (bubblewrap or unshare), rlimits, timeout, capped
output; refused where no namespaces can be made, unless weaker isolation is opted in."""

from tasks.sandbox.isolation import (
    ISOLATION_CHOICES,
    ISOLATION_ENV,
    SandboxUnavailable,
    resolve_isolation,
)
from tasks.sandbox.process import Limits, SandboxResult
from tasks.sandbox.sandbox import Sandbox, SandboxPool, run_code

__all__ = [
    "ISOLATION_CHOICES",
    "ISOLATION_ENV",
    "Limits",
    "Sandbox",
    "SandboxPool",
    "SandboxResult",
    "SandboxUnavailable",
    "resolve_isolation",
    "run_code",
]
