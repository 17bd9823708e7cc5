"""The documentation against the code: every `tierserve ...` command line in the README, docs/
and the model cards parses with the real command-line parser, every gateway config example
validates, every relative link (and its #anchor) resolves in the repository, and the docs do
not point at history that is not in it."""

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml

from serving.cli import build_parser, command_modules
from serving.gateway.config import GatewayConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "models").glob("**/README.md"),
        ROOT / "training" / "README.md",
        ROOT / "loadtests" / "README.md",
    ]
)
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
ELLIPSIS = "..."


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def shell_lines(block: str) -> list[str]:
    """A code block's logical lines: backslash continuations joined."""
    return block.replace("\\\n", " ").splitlines()


def tierserve_commands(line: str) -> list[list[str]]:
    """The `tierserve ...` invocations of one shell line (after `&&`, `;`, `|`, env vars)."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:
        return []
    commands, current = [], []
    for token in [*tokens, ";"]:
        if token and set(token) <= set(";&|"):
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    found = []
    for command in commands:
        while command and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", command[0]):
            command = command[1:]  # OMP_NUM_THREADS=1 tierserve ...
        if command and command[0] == "tierserve":
            found.append(command[1:])
    return found


def all_commands() -> list[tuple[str, str, list[str], bool]]:
    """(file, the line as written, argv, whether inline) for every tierserve command in the
    docs. A code block's lines are meant to run; inline code may name a command with some of
    its options only (`tierserve engine --device cuda`)."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for lang, block in fenced_blocks(text):
            if lang in ("", "bash", "sh", "shell", "console"):
                for line in shell_lines(block):
                    line = line.strip().removeprefix("$ ")
                    out += [(rel(path), line, argv, False) for argv in tierserve_commands(line)]
        for m in INLINE.finditer(prose(text)):
            span = m.group(1).strip()
            if span.startswith("tierserve ") or " tierserve " in span:
                out += [(rel(path), span, argv, True) for argv in tierserve_commands(span)]
    return out


COMMANDS = all_commands()


def subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser] + [p for a in subs for child in a.choices.values() for p in subparsers(child)]


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    """The real `tierserve` parser, taking options only as spelled in full: the docs show
    `--users`, not the `--user` argparse would also accept."""
    root = build_parser(command_modules())
    for p in subparsers(root):
        p.allow_abbrev = False
    return root


def subparser_for(parser: argparse.ArgumentParser, argv: list[str]):
    """The parser of the deepest subcommand that argv names, and the rest of argv."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or not argv or argv[0] not in subs[0].choices:
            return parser, argv
        parser, argv = subs[0].choices[argv[0]], argv[1:]


def parse_error(
    parser: argparse.ArgumentParser, argv: list[str], partial: bool = False
) -> str | None:
    """None when argv parses; else argparse's message. A command shown with `...` (an
    elision), or a partial one, needs only to name a real subcommand and real options of it:
    a wrong option or value still fails, a required one left out does not."""
    err = io.StringIO()
    if ELLIPSIS in argv:
        sub, rest = subparser_for(parser, [a for a in argv if a != ELLIPSIS])
        if sub is parser:
            return f"no such command: {argv[:1]}"
        known = {s for a in sub._actions for s in a.option_strings}
        unknown = [a.split("=")[0] for a in rest if a.startswith("-")]
        unknown = [a for a in unknown if a not in known]
        return f"{sub.prog}: unknown options {unknown}" if unknown else None
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            message = err.getvalue().strip().splitlines()[-1]
            if partial and re.search(r"(arguments are|is) required", message):
                return parse_error(parser, [*argv, ELLIPSIS])
            return message
    return None


def test_the_docs_show_commands():
    files = {path for path, _, _, _ in COMMANDS}
    assert "README.md" in files and any(p.startswith("docs/") for p in files)
    assert len(COMMANDS) > 20


@pytest.mark.parametrize(
    "where,line,argv,partial", COMMANDS, ids=[f"{p}: {line[:70]}" for p, line, _, _ in COMMANDS]
)
def test_command_parses(parser, where, line, argv, partial):
    error = parse_error(parser, argv, partial)
    assert error is None, f"{where}: `{line}`: {error}"


def test_a_wrong_flag_fails(parser):
    assert parse_error(parser, ["serve", "--config", "g.yaml"]) is None
    assert parse_error(parser, ["serve", "--confg", "g.yaml"]) is not None
    assert parse_error(parser, ["loadtest", "--user", "16"]) is not None  # an abbreviation
    assert parse_error(parser, ["train", "sft", "--out", "x", "--stlye", "think"]) is not None
    assert parse_error(parser, ["train", "sft", ELLIPSIS, "--stlye", "think"]) is not None
    assert parse_error(parser, ["init-checkpoint", "out"]) is not None
    assert parse_error(parser, ["engine"]) is not None  # a code block's line must run
    assert parse_error(parser, ["engine"], partial=True) is None  # inline may elide
    assert parse_error(parser, ["engine", "--devcie", "cpu"], partial=True) is not None
    assert parse_error(parser, ["quantize", "--format", "fp3"], partial=True) is not None
    assert tierserve_commands("OMP_NUM_THREADS=1 tierserve engine --model m && curl x") == [
        ["engine", "--model", "m"]
    ]


def test_stage_commands_configs_validate(parser):
    """A documented `tierserve train STAGE --config F --set k=v` names real config fields, and
    `tierserve train recipe NAME` a real recipe."""
    from training.commands import run_recipe_command, run_stage_command
    from training.recipes.run import recipe_dir
    from training.stages.run import load_stage_config

    checked, errors = 0, []
    for where, line, argv, partial in COMMANDS:
        if partial or ELLIPSIS in argv:
            continue
        args = parser.parse_args(argv)
        try:
            if args.run is run_stage_command:
                fields = {"stage": args.stage}
                for key in ("init", "style", "tokenizer"):
                    if getattr(args, key, None) is not None:
                        fields[key] = str(getattr(args, key))
                config = ROOT / args.config if args.config else None
                load_stage_config(config, args.set, **fields)
            elif args.run is run_recipe_command:
                recipe_dir(args.name)
            else:
                continue
        except ValueError as e:
            errors.append(f"{where}: `{line}`: {e}")
        checked += 1
    assert not errors, "\n".join(errors)
    assert checked >= 5


def gateway_configs() -> list[tuple[str, str]]:
    """YAML blocks that say they are a gateway config (first line `# gateway.yaml`)."""
    return [
        (rel(path), block)
        for path in DOCS
        for lang, block in fenced_blocks(path.read_text())
        if lang == "yaml" and block.startswith("# gateway.yaml")
    ]


@pytest.mark.parametrize("where,block", gateway_configs())
def test_gateway_config_example_validates(where, block):
    GatewayConfig.model_validate(yaml.safe_load(block) or {})


def test_there_are_gateway_config_examples():
    assert len(gateway_configs()) >= 2


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for m in re.finditer(r"^#{1,6} (.+)$", prose(path.read_text()), re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for m in LINK.finditer(prose(path.read_text())):
            target = m.group(1)
            if not re.match(r"[a-z]+:", target):
                out.append((rel(path), target))
    return out


@pytest.mark.parametrize("where,target", links())
def test_relative_link_resolves(where, target):
    file, _, anchor = target.partition("#")
    source = ROOT / where
    resolved = (source.parent / file).resolve() if file else source
    assert resolved.is_relative_to(ROOT), f"{where}: {target} points outside the repository"
    assert resolved.exists(), f"{where}: {target} does not exist"
    if anchor and resolved.suffix == ".md":
        assert anchor in anchors(resolved), f"{where}: no heading #{anchor} in {file or where}"


@pytest.mark.parametrize("path", DOCS, ids=rel)
def test_no_history_outside_the_repository(path):
    """History lives in the git log: no stops, issue numbers or run directories."""
    text = path.read_text()
    for pattern in (
        r"\b[Ss]tops? \d+",
        r"\b[Ii]ssues? #?\d+",
        r"(?<![\w&])#\d+\b",
        r"\bruns/[a-z0-9]",
    ):
        hits = [m.group(0) for m in re.finditer(pattern, text)]
        if pattern.startswith(r"\bruns/"):  # a directory a command shown creates is fine
            hits = [
                line
                for line in text.splitlines()
                if re.search(pattern, line)
                and not re.search(r"--(work|out|models|init|tokenizer) runs/", line)
            ]
        assert not hits, f"{rel(path)}: {hits[:5]}"
