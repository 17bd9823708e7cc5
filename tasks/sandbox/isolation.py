"""How a sandbox isolates the programs it runs, and the command that runs one so.

Untrusted code runs only inside new network, PID, mount, IPC and UTS namespaces, as an
unprivileged uid, with no capabilities and no_new_privs (setuid binaries grant nothing). It
sees read-only system directories, a fresh /proc of its own PID namespace (no host process),
a private /tmp, a minimal /dev, an empty network (no route anywhere, not even to the host's
loopback, and no abstract unix sockets) and, writable, only its working directory at /sandbox.
Two mechanisms make those namespaces; `auto` takes the first that works here (probed once per
process by running /bin/true under it):

- `bubblewrap` (Debian's `bubblewrap`): new user namespace too, the program runs as uid 1000.
- `unshare` (util-linux, part of every Debian and Ubuntu base system): as root, the
  namespaces directly and the program as the sandbox's host uid (`setpriv`); otherwise inside a user
  namespace, and the program as uid 1000 of a nested one, as under bubblewrap. The same mount
  layout as bubblewrap's is built on a tmpfs and entered with pivot_root.

The rlimits are set inside by `prlimit`. The kernel never applies the process limit to host
root, in any namespace, so when we are root each sandbox runs as a host uid of its own
(`UidLease`): that limit counts every process of a uid on the host, and sandboxes sharing one
would share one budget (a fork bomb in one would stop bash in the others from forking).

When neither mechanism works the sandbox fails closed: `SandboxUnavailable`, naming the fix.
Only a caller who opts in (`isolation="rlimits"`, `--isolation rlimits` or
TIERSERVE_SANDBOX_ISOLATION=rlimits) gets the weak fallback, which the result
(`isolation="rlimits"`) and a log warning name: rlimits, a process group, a scrubbed
environment and the working directory as cwd. It does NOT stop network access, reads of
whatever the running user may read, writes wherever it may write (as root, the sandbox's own
uid: world-writable places such as /tmp), signals to the user's other processes, or processes
that leave the group with setsid; and when we are not root its process limit counts every
process of the running user.
"""

import fcntl
import functools
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

ISOLATION_ENV = "TIERSERVE_SANDBOX_ISOLATION"
NAMESPACED = ("bubblewrap", "unshare")  # what `auto` tries, strongest first
ISOLATION_CHOICES = ("auto", *NAMESPACED, "rlimits")
WORKDIR = "/sandbox"  # where the working directory appears inside the namespaces
PROGDIR = "/prog"  # the program file and nothing else, read-only
AS_ROOT = os.geteuid() == 0  # then each sandbox leases a host uid, see above
FIRST_UID = 0x7E000000  # leased uids: unassigned, above systemd's container range, below 2^31
UIDS = 4096  # sandboxes alive at once on one host, as root
UID_LOCK_DIRS = ("/run", tempfile.gettempdir())  # the first writable one holds the uid locks
INNER_ID = "1000"  # the program's uid and gid inside a user namespace
# Stdlib only, never the venv's packages: the system python3, else this process's base
# interpreter (its prefix is then bound read-only; any uid must be able to read it).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
PYTHON = os.path.realpath(SYSTEM_PYTHON or sys.executable)
_TOOLS = {"bubblewrap": "bwrap", "unshare": "unshare"}
_BWRAP_ARGS = [
    "--unshare-all",
    "--unshare-user",  # --unshare-all only tries; without it root would stay root
    "--uid", INNER_ID,
    "--gid", INNER_ID,
    "--cap-drop", "ALL",
    "--die-with-parent",
    "--new-session",
    "--clearenv",
]  # fmt: skip
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")  # what bwrap's --dev offers
_FIX = (
    "install bubblewrap (`apt-get install bubblewrap`) or allow user namespaces "
    "(sysctl kernel.unprivileged_userns_clone=1), or opt in to weak rlimits-only isolation "
    f"with `--isolation rlimits` or {ISOLATION_ENV}=rlimits"
)


class SandboxUnavailable(Exception):
    """No requested isolation works here: untrusted code is refused rather than run bare.
    Not a RuntimeError: callers that score a failed request as 0 must not swallow it."""


class UidLease:
    """A host uid no account and no other live sandbox uses, held until `release`.

    An flock on a file named after the uid marks it taken: the lock holds across processes
    (an eval, a training run and test workers at once) and the kernel drops it when its
    holder dies, so a crash leaks nothing. The lock files stay, empty: as many as sandboxes
    were ever alive at once."""

    def __init__(self) -> None:
        lock_dir = _uid_lock_dir()
        for uid in range(FIRST_UID, FIRST_UID + UIDS):
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(lock_dir / str(uid), flags, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid = uid
            self._lock = open(fd, "rb")  # noqa: SIM115 (held past this call; closed, so released, with the object)
            return
        raise SandboxUnavailable(f"all {UIDS} sandbox uids are in use ({lock_dir})")

    def release(self) -> None:
        self._lock.close()


def _uid_lock_dir() -> Path:
    """Root's own directory: nobody else may create, hold or swap the lock files."""
    for parent in UID_LOCK_DIRS:
        path = Path(parent) / "tierserve-uids"
        try:
            path.mkdir(mode=0o700, exist_ok=True)
        except OSError:  # e.g. a read-only /run in a container
            continue
        info = path.lstat()
        if path.is_symlink() or not path.is_dir() or info.st_uid != 0 or info.st_mode & 0o022:
            raise SandboxUnavailable(f"{path} must be a directory of root's that only root writes")
        return path
    raise SandboxUnavailable(f"no writable place for the sandbox uid locks: {UID_LOCK_DIRS}")


def _tool(name: str) -> str:
    """A system tool's absolute path: the same path exists inside the new root."""
    return shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin") or name


def _layout(tmp: Path) -> list[tuple[str, ...]]:
    """The filesystem inside, as bubblewrap options; the unshare path builds the same.
    Read-only system directories with merged-/usr symlinks kept as symlinks, fresh /proc,
    /dev and /tmp, the work dir writable and the program read-only."""
    ops: list[tuple[str, ...]] = [("--proc", "/proc"), ("--dev", "/dev"), ("--tmpfs", "/tmp")]
    ops.append(("--ro-bind", "/usr", "/usr"))
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            ops.append(("--symlink", os.readlink(top), top))
        elif os.path.isdir(top):
            ops.append(("--ro-bind", top, top))
    ops += [
        ("--ro-bind", p, p) for p in ("/etc/alternatives", "/etc/ld.so.cache") if os.path.exists(p)
    ]
    if SYSTEM_PYTHON is None:
        ops.append(("--ro-bind", sys.base_prefix, sys.base_prefix))
    ops += [("--bind", str(tmp / "work"), WORKDIR), ("--ro-bind", str(tmp / "prog"), PROGDIR)]
    return ops


def _bwrap_argv(tmp: Path, env: dict[str, str], program: list[str]) -> list[str]:
    argv = [_tool("bwrap"), *_BWRAP_ARGS, *(arg for op in _layout(tmp) for arg in op)]
    argv += ["--remount-ro", "/", "--chdir", WORKDIR]  # writable: work dir and /tmp
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return [*argv, "--", *program]


def _mount(op: tuple[str, ...], root: str) -> list[str]:
    """Shell commands that do one bubblewrap layout option under `root`."""
    kind, *args = op
    q = shlex.quote
    mount = q(_tool("mount"))
    dst = q(root + args[-1])
    if kind in ("--bind", "--ro-bind"):
        src = args[0]
        if os.path.isdir(src):
            make = [f"mkdir -p {dst}"]
        else:
            make = [f"mkdir -p {q(os.path.dirname(root + args[-1]))}", f"touch {dst}"]
        ro = "ro," if kind == "--ro-bind" else ""
        return [
            *make,
            f"{mount} --bind {q(src)} {dst}",
            f"{mount} -o remount,bind,{ro}nosuid,nodev {dst}",
        ]
    if kind == "--symlink":
        return [f"ln -s {q(args[0])} {dst}"]
    if kind == "--proc":
        return [f"mkdir -p {dst}", f"{mount} -t proc -o nosuid,nodev,noexec proc {dst}"]
    if kind == "--tmpfs":
        return [f"mkdir -p {dst}", f"{mount} -t tmpfs -o mode=1777,nosuid,nodev tmpfs {dst}"]
    assert kind == "--dev", kind
    lines = [f"mkdir -p {dst}", f"{mount} -t tmpfs -o mode=755,nosuid tmpfs {dst}"]
    for name in _DEVICES:
        lines += [f"touch {dst}/{name}", f"{mount} --bind /dev/{name} {dst}/{name}"]
    links = {
        "fd": "/proc/self/fd",
        "stdin": "/proc/self/fd/0",
        "stdout": "/proc/self/fd/1",
        "stderr": "/proc/self/fd/2",
    }
    lines += [f"ln -s {target} {dst}/{name}" for name, target in links.items()]
    return [*lines, f"mkdir -m 1777 {dst}/shm"]


def _unshare_argv(tmp: Path, program: list[str], uid: int | None) -> list[str]:
    """util-linux's unshare and a setup script as the namespace's pid 1: it builds the layout
    on a tmpfs, pivots into it and waits for the program, which it starts as the unprivileged
    uid. Pid 1 never changes uid, so it keeps unshare's parent-death signal: the namespace
    dies with unshare, and unshare (by setpriv's) with our thread. One command a line:
    `set -e` stops at any failure."""
    root = str(tmp / "root")
    q = shlex.quote
    lines = ["set -e", f"{q(_tool('mount'))} -t tmpfs -o mode=755,nosuid,nodev tmpfs {q(root)}"]
    for op in _layout(tmp):
        lines += _mount(op, root)
    lines += [
        f"cd {q(root)}",
        "mkdir .old",
        f"{q(_tool('pivot_root'))} . .old",
        f"{q(_tool('umount'))} -l /.old",  # nothing of the host's tree is left
        "rmdir /.old",
        f"{q(_tool('mount'))} -o remount,bind,ro /",
        f"cd {WORKDIR}",
        "unset OLDPWD",  # the program's env is env and PWD=/sandbox, as under bubblewrap
    ]
    drop = [_tool("setpriv"), "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"]
    outer = [_tool("unshare"), "--net", "--pid", "--mount", "--ipc", "--uts", "--fork"]
    outer.append("--kill-child")
    if uid is not None:
        drop[1:1] = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    else:  # no other uid exists in our user namespace: a nested one maps it to 1000, and
        # keeps its capabilities just long enough for setpriv to empty the bounding set
        outer[1:1] = ["--user", "--map-root-user"]
        nested = [_tool("unshare"), "--user", f"--map-user={INNER_ID}"]
        drop[:0] = [*nested, f"--map-group={INNER_ID}", "--keep-caps", "--"]
    lines += [shlex.join([*drop, "--", *program]), "exit $?"]  # not exec'd: pid 1 stays root
    script = "\n".join(lines)
    return [_tool("setpriv"), "--pdeathsig=KILL", "--", *outer, "--", "/bin/sh", "-c", script]


def _popen_user(uid: int | None) -> dict:
    """Popen's own uid switch (no preexec_fn, which is unsafe with the pool's threads)."""
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def isolated_command(
    isolation: str, tmp: Path, program: list[str], uid: int | None
) -> tuple[list[str], dict[str, str], dict]:
    """(argv, env, Popen's extra arguments) that run `program` (paths as seen inside) under
    `isolation`, as the host uid `uid` (None: as we are, when we are not root). unshare must
    start as whoever we are: as root it makes the namespaces without a user namespace and
    drops to `uid` itself."""
    if isolation == "bubblewrap":
        env = _env(WORKDIR)  # bwrap's own process must not hold secrets: /proc/1/environ shows it
        return _bwrap_argv(tmp, env, program), env, _popen_user(uid)
    if isolation == "unshare":
        return _unshare_argv(tmp, program, uid), _env(WORKDIR), {}
    assert isolation == "rlimits", isolation
    return program, _env(str(tmp / "work")), _popen_user(uid)


def make_dirs(files: dict[str, str], uid: int | None) -> Path:
    """A temporary directory with work/ (holding `files`), prog/ and root/ (the unshare
    path's mount point for the new root); work/ belongs to `uid` when we are root."""
    tmp = Path(tempfile.mkdtemp(prefix="tierserve-sandbox-"))
    (tmp / "prog").mkdir(mode=0o755)
    (tmp / "root").mkdir(mode=0o755)
    work = tmp / "work"
    work.mkdir()
    for rel, text in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    if uid is not None:
        tmp.chmod(0o711)  # the program may pass through to work/ and prog/, not list
        for dirpath, _, filenames in os.walk(work):
            for path in [dirpath, *(os.path.join(dirpath, f) for f in filenames)]:
                os.chown(path, uid, uid)
    return tmp


def remove_dirs(tmp: Path) -> None:
    """Delete the directory, even where the program took its own permissions away."""
    for dirpath, dirnames, _ in os.walk(tmp):  # top-down: fixed before listed
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
    shutil.rmtree(tmp)


@functools.cache
def probe(isolation: str) -> str | None:
    """None when `isolation` can run a program here, else why not (tried once per process:
    user namespaces may be disabled, a container may forbid mounts)."""
    tool = shutil.which(_TOOLS[isolation], path="/usr/sbin:/usr/bin:/sbin:/bin")
    if tool is None:
        return f"{_TOOLS[isolation]} is not installed"
    lease = UidLease() if AS_ROOT else None
    uid = lease.uid if lease else None
    tmp = make_dirs({}, uid)
    try:
        argv, env, popen_kwargs = isolated_command(isolation, tmp, ["/bin/true"], uid)
        run = subprocess.run(
            argv, cwd=tmp / "work", env=env, capture_output=True, timeout=30, check=False,
            **popen_kwargs,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"{tool} did not run /bin/true within 30 s"
    finally:
        remove_dirs(tmp)
        if lease:
            lease.release()
    if run.returncode == 0:
        return None
    why = run.stderr.decode(errors="replace").strip().splitlines()
    return f"{tool} failed: {why[-1] if why else f'exit {run.returncode}'}"


@functools.cache
def _log_choice(isolation: str) -> None:
    """Once per process: the logs, not only each result, name the isolation in use."""
    if isolation == "rlimits":
        log.warning(
            "sandbox: isolation 'rlimits' opted in: untrusted code runs with rlimits only, "
            "without network, filesystem or process isolation"
        )
    else:
        log.info("sandbox: isolation %r", isolation)


def resolve_isolation(requested: str | None = None) -> str:
    """The isolation a run gets: `requested`, else $TIERSERVE_SANDBOX_ISOLATION, else auto
    (the first namespaced one that works). Fails closed: rlimits only when asked for."""
    requested = requested or os.environ.get(ISOLATION_ENV) or "auto"
    if requested not in ISOLATION_CHOICES:  # a typo in the env must not weaken anything
        raise SandboxUnavailable(
            f"unknown sandbox isolation {requested!r} (choose from {', '.join(ISOLATION_CHOICES)})"
        )
    if requested == "rlimits":
        _log_choice(requested)
        return requested
    tried = NAMESPACED if requested == "auto" else (requested,)
    problems = []
    for isolation in tried:
        problem = probe(isolation)
        if problem is None:
            _log_choice(isolation)
            return isolation
        problems.append(f"{isolation}: {problem}")
    raise SandboxUnavailable(
        f"refusing to run untrusted code: no sandbox isolation works here "
        f"({'; '.join(problems)}); {_FIX}"
    )


def _env(home: str) -> dict[str, str]:
    # No bytecode caches: verifiers compare the tree, and __pycache__ is noise there.
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "LANG": "C.UTF-8",
        "PYTHONPATH": home,
        "PYTHONDONTWRITEBYTECODE": "1",
    }
