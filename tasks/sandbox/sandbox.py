"""Sandboxes: a private working directory in which untrusted Python or bash runs, isolated
as `isolation.py` describes, under rlimits and a timeout (`process.py`)."""

import os
import stat
import tempfile
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tasks.sandbox.isolation import (
    AS_ROOT,
    PROGDIR,
    PYTHON,
    UidLease,
    isolated_command,
    make_dirs,
    remove_dirs,
    resolve_isolation,
)
from tasks.sandbox.process import Limits, SandboxResult, run_limited

INTERPRETERS = {"python": (PYTHON, "main.py"), "bash": ("/bin/bash", "main.sh")}


class Sandbox:
    """A private working directory whose files persist across runs (a terminal episode)."""

    def __init__(
        self,
        files: dict[str, str] | None = None,
        limits: Limits | None = None,
        isolation: str | None = None,
    ) -> None:
        files = files or {}
        for rel in files:
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise ValueError(f"sandbox file path escapes the work dir: {rel!r}")
        self.isolation = resolve_isolation(isolation)  # before anything exists: may refuse
        self.limits = limits or Limits()
        self._lease = UidLease() if AS_ROOT else None
        try:
            self._tmp = make_dirs(files, self.uid)
        except BaseException:
            self._release()
            raise

    @property
    def uid(self) -> int | None:
        """The host uid its programs run as: its own when we are root, else ours (None)."""
        return self._lease.uid if self._lease else None

    @property
    def root(self) -> Path:
        return self._tmp / "work"

    def run(self, lang: str, source: str, stdin: str = "") -> SandboxResult:
        """Run `source` with the work dir as cwd; stdin comes from a file, so a program that
        never reads it cannot block us."""
        if lang not in INTERPRETERS:
            raise ValueError(f"unknown sandbox language {lang!r} (python or bash)")
        interpreter, name = INTERPRETERS[lang]
        prog = self._tmp / "prog" / name
        prog.write_text(source)
        prog.chmod(0o644)
        script = str(prog) if self.isolation == "rlimits" else f"{PROGDIR}/{name}"
        program = ["prlimit", *self.limits.prlimit_args(), "--", interpreter, script]
        argv, env, popen_kwargs = isolated_command(self.isolation, self._tmp, program, self.uid)
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode())
            stdin_file.seek(0)
            return run_limited(
                argv,
                cwd=str(self.root),
                env=env,
                stdin=stdin_file,
                limits=self.limits,
                isolation=self.isolation,
                popen_kwargs=popen_kwargs,
            )

    def tree(self) -> dict[str, str]:
        """Every regular file in the work dir as text. Symlinks are skipped, never followed:
        a link to a host file must not leak it into a verifier's view."""
        out = {}
        for dirpath, _, filenames in os.walk(self.root):
            for filename in filenames:
                path = os.path.join(dirpath, filename)
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    continue
                try:  # a program may chmod 000 a file: it is left out
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                except OSError:
                    continue
                with open(fd, "rb") as f:
                    rel = os.path.relpath(path, self.root)
                    out[rel] = f.read().decode("utf-8", errors="replace")
        return dict(sorted(out.items()))

    def close(self) -> None:
        try:
            remove_dirs(self._tmp)
        finally:
            self._release()

    def _release(self) -> None:
        if self._lease:
            self._lease.release()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_code(
    lang: str,
    source: str,
    files: dict[str, str] | None = None,
    limits: Limits | None = None,
    stdin: str = "",
    isolation: str | None = None,
) -> SandboxResult:
    """One run in a fresh work dir that is deleted afterwards."""
    with Sandbox(files, limits, isolation) as box:
        return box.run(lang, source, stdin)


class SandboxPool:
    """Bounded parallel runs: at most `max_workers` sandboxes exist at once."""

    def __init__(
        self,
        max_workers: int | None = None,
        limits: Limits | None = None,
        isolation: str | None = None,
    ) -> None:
        self.limits = limits
        self.isolation = resolve_isolation(isolation)  # refuse now, not in every job
        self._executor = ThreadPoolExecutor(max_workers or os.cpu_count() or 1)

    def submit(
        self, lang: str, source: str, files: dict[str, str] | None = None, stdin: str = ""
    ) -> Future[SandboxResult]:
        return self._executor.submit(
            run_code, lang, source, files, self.limits, stdin, self.isolation
        )

    def map(self, jobs: Iterable[tuple[str, str, dict[str, str] | None]]) -> list[SandboxResult]:
        """Run (lang, source, files) jobs; results in the jobs' order."""
        futures = [self.submit(lang, source, files) for lang, source, files in jobs]
        return [future.result() for future in futures]

    def close(self) -> None:
        self._executor.shutdown()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
