"""The `tierserve` command: each package contributes its subcommands.

A package lists a module under the `tierserve.commands` entry point group (pyproject.toml);
the module has `add_commands(subparsers)` and `USER_ERRORS`, the exceptions that mean "bad
input", not "bug". So the command is put together here without `serving` importing
`training`: the layers stay one-way and each package owns its own commands.

Expected failures (a missing or malformed checkpoint, a prompt that does not fit) print one
line and exit with status 2; only bugs show a traceback.
"""

import argparse
import json
import sys
from importlib.metadata import entry_points
from types import ModuleType

GROUP = "tierserve.commands"


def command_modules() -> list[ModuleType]:
    """The contributing modules, in their entry points' name order."""
    return [ep.load() for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name)]


def build_parser(modules: list[ModuleType]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierserve", description="Tiered LLM inference serving over one sparse MoE family."
    )
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    for module in modules:
        module.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    modules = command_modules()
    args = build_parser(modules).parse_args(argv)
    user_errors = (OSError, json.JSONDecodeError)
    for module in modules:
        user_errors += module.USER_ERRORS
    try:
        args.run(args)
    except user_errors as e:
        print(f"tierserve: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C: uvicorn re-raises it once it has shut down cleanly
        sys.exit(130)
