"""Sandboxes: a private working directory in which untrusted Python or bash runs.

Under bubblewrap each run gets new user, PID, network, IPC, UTS and mount namespaces: it
sees read-only system directories, a private /tmp, an empty network (no route anywhere, not
even to the host's loopback) and, writable, only its working directory at /sandbox. The
rlimits are set inside the namespaces by `prlimit`, so the process limit counts this run's
processes only. The kernel never applies that limit to host root, in any namespace, so when
we are root every run (bubblewrap or not) runs as nobody.

Where bubblewrap is missing or cannot create namespaces, runs fall back to rlimits, a
process group, a scrubbed environment and the working directory as cwd, and report
`isolation="rlimits"`. That fallback does NOT stop network access, reads of whatever the
running user may read, writes wherever it may write (for nobody: world-writable places such
as /tmp), or processes that leave the group with setsid; and its process limit counts every
process of the running user, so a non-root user with many processes may see forks fail.
"""

import functools
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from training.tasks.sandbox.process import Limits, SandboxResult, run_limited

WORKDIR = "/sandbox"  # where the working directory appears under bubblewrap
PROGDIR = "/prog"  # the program file and nothing else, read-only
RUN_AS = 65534 if os.geteuid() == 0 else None  # nobody, see above
# Stdlib only, never the venv's packages: the system python3, else this process's base
# interpreter (its prefix is then bound read-only; nobody must be able to read it).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
PYTHON = os.path.realpath(SYSTEM_PYTHON or sys.executable)
INTERPRETERS = {"python": (PYTHON, "main.py"), "bash": ("/bin/bash", "main.sh")}
_BWRAP_ARGS = [
    "--unshare-all",
    "--unshare-user",  # --unshare-all only tries; without it root would stay root
    "--uid", "1000",
    "--gid", "1000",
    "--cap-drop", "ALL",
    "--die-with-parent",
    "--new-session",
    "--proc", "/proc",
    "--dev", "/dev",
    "--tmpfs", "/tmp",
    "--clearenv",
]  # fmt: skip


def _system_binds() -> list[str]:
    """Read-only binds of what python3 and bash need: merged-/usr symlinks stay symlinks."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in ("/etc/alternatives", "/etc/ld.so.cache"):
        args += ["--ro-bind-try", path, path]
    if SYSTEM_PYTHON is None:
        args += ["--ro-bind", sys.base_prefix, sys.base_prefix]
    return args


def _popen_user() -> dict:
    """Popen's own uid switch (no preexec_fn, which is unsafe with the pool's threads)."""
    return {} if RUN_AS is None else {"user": RUN_AS, "group": RUN_AS, "extra_groups": []}


@functools.cache
def bwrap_available() -> bool:
    """Whether bubblewrap is installed and may create the namespaces here (once per process)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return False
    argv = [bwrap, *_BWRAP_ARGS, *_system_binds(), "--", "/bin/true"]
    probe = subprocess.run(argv, capture_output=True, env={}, check=False, **_popen_user())
    return probe.returncode == 0


def _env(home: str) -> dict[str, str]:
    # No bytecode caches: verifiers compare the tree, and __pycache__ is noise there.
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "LANG": "C.UTF-8",
        "PYTHONPATH": home,
        "PYTHONDONTWRITEBYTECODE": "1",
    }


class Sandbox:
    """A private working directory whose files persist across runs (a terminal episode)."""

    def __init__(self, files: dict[str, str] | None = None, limits: Limits | None = None) -> None:
        files = files or {}
        for rel in files:
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise ValueError(f"sandbox file path escapes the work dir: {rel!r}")
        self.limits = limits or Limits()
        self._tmp = Path(tempfile.mkdtemp(prefix="tierserve-sandbox-"))
        self._prog = self._tmp / "prog"
        self._prog.mkdir(mode=0o755)
        self.root.mkdir()
        for rel, text in files.items():
            (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.root / rel).write_text(text)
        if RUN_AS is not None:
            self._tmp.chmod(0o711)  # nobody may pass through to work/ and prog/, not list
            for dirpath, _, filenames in os.walk(self.root):
                for path in [dirpath, *(os.path.join(dirpath, f) for f in filenames)]:
                    os.chown(path, RUN_AS, RUN_AS)

    @property
    def root(self) -> Path:
        return self._tmp / "work"

    def run(self, lang: str, source: str, stdin: str = "") -> SandboxResult:
        """Run `source` with the work dir as cwd; stdin comes from a file, so a program that
        never reads it cannot block us."""
        if lang not in INTERPRETERS:
            raise ValueError(f"unknown sandbox language {lang!r} (python or bash)")
        interpreter, name = INTERPRETERS[lang]
        (self._prog / name).write_text(source)
        (self._prog / name).chmod(0o644)
        limits = ["prlimit", *self.limits.prlimit_args(), "--"]
        if bwrap_available():
            argv = [shutil.which("bwrap") or "bwrap", *_BWRAP_ARGS, *_system_binds()]
            argv += ["--bind", str(self.root), WORKDIR, "--ro-bind", str(self._prog), PROGDIR]
            argv += ["--remount-ro", "/", "--chdir", WORKDIR]  # writable: work dir and /tmp
            for key, value in _env(WORKDIR).items():
                argv += ["--setenv", key, value]
            argv += ["--", *limits, interpreter, f"{PROGDIR}/{name}"]
            isolation, env = "bubblewrap", _env(WORKDIR)
        else:
            argv = [*limits, interpreter, str(self._prog / name)]
            isolation, env = "rlimits", _env(str(self.root))
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode())
            stdin_file.seek(0)
            return run_limited(
                argv,
                cwd=str(self.root),
                env=env,  # bwrap's own process must not hold secrets: /proc/1/environ shows it
                stdin=stdin_file,
                limits=self.limits,
                isolation=isolation,
                popen_kwargs=_popen_user(),
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
        """Delete the directory, even where the program took its own permissions away."""
        for dirpath, dirnames, _ in os.walk(self._tmp):  # top-down: fixed before listed
            for name in dirnames:
                path = os.path.join(dirpath, name)
                if not os.path.islink(path):
                    os.chmod(path, 0o700)
        shutil.rmtree(self._tmp)

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
) -> SandboxResult:
    """One run in a fresh work dir that is deleted afterwards."""
    with Sandbox(files, limits) as box:
        return box.run(lang, source, stdin)


class SandboxPool:
    """Bounded parallel runs: at most `max_workers` sandboxes exist at once."""

    def __init__(self, max_workers: int | None = None, limits: Limits | None = None) -> None:
        self.limits = limits
        self._executor = ThreadPoolExecutor(max_workers or os.cpu_count() or 1)

    def submit(
        self, lang: str, source: str, files: dict[str, str] | None = None, stdin: str = ""
    ) -> Future[SandboxResult]:
        return self._executor.submit(run_code, lang, source, files, self.limits, stdin)

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
