"""The tasks' subcommand: `sandbox exec`, one untrusted file run the way the verifiers run code."""

import argparse
import json
from pathlib import Path

from tasks.sandbox import ISOLATION_CHOICES, ISOLATION_ENV, SandboxUnavailable

USER_ERRORS = (SandboxUnavailable,)


def run_sandbox_exec(args: argparse.Namespace) -> None:
    from tasks.sandbox import Limits, run_code

    limits = Limits() if args.timeout is None else Limits(timeout_s=args.timeout)
    result = run_code(args.lang, args.file.read_text(), limits=limits, isolation=args.isolation)
    print(json.dumps(result.to_json()))


def add_sandbox(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("sandbox", help="run untrusted code in the execution sandbox")
    actions = parser.add_subparsers(required=True, metavar="ACTION")
    exec_parser = actions.add_parser("exec", help="run one file and print the JSON result")
    exec_parser.add_argument("--lang", required=True, choices=["python", "bash"])
    exec_parser.add_argument("file", type=Path)
    exec_parser.add_argument("--timeout", type=float, help="wall-clock seconds (default 5)")
    exec_parser.add_argument(
        "--isolation",
        choices=ISOLATION_CHOICES,
        help=f"default ${ISOLATION_ENV}, else auto: bubblewrap, else unshare, else refuse; "
        "rlimits: no namespaces, only if you accept running the file nearly unconfined",
    )
    exec_parser.set_defaults(run=run_sandbox_exec)


def add_commands(sub: argparse._SubParsersAction) -> None:
    add_sandbox(sub)
