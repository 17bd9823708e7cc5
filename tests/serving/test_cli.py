"""The `tierserve` command line: offline generation and one-line errors."""

from pathlib import Path

import pytest

from serving.cli import main


def test_generate(random_checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    main(["generate", "--model", str(random_checkpoint), "--max-tokens", "3", "def main():"])
    plain = capsys.readouterr().out
    main(["generate", "--model", str(random_checkpoint), "--max-tokens", "3", "--chat", "Hi"])
    assert plain.strip() and capsys.readouterr().out.strip()


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--model", "/no/such/checkpoint", "hello"],
        ["engine", "--model", "/no/such/checkpoint"],
        ["init-checkpoint", "/tmp/unused", "--shape", "/no/such/shape.json"],
    ],
)
def test_errors_are_one_line(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tierserve: error:") and err.count("\n") == 1


def test_prompt_too_long(random_checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(random_checkpoint), "--max-model-len", "8", "x " * 20])
    assert e.value.code == 2 and "maximum context length" in capsys.readouterr().err
