"""The `tierserve` command line: offline generation and one-line errors."""

from pathlib import Path

import pytest

from serving.cli import main

# One prompt each: compiling decode steps in the background would only cost time.
GENERATE = ["generate", "--enforce-eager", "--model"]


def test_generate(random_checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    main([*GENERATE, str(random_checkpoint), "--max-tokens", "3", "def main():"])
    plain = capsys.readouterr().out
    main([*GENERATE, str(random_checkpoint), "--max-tokens", "3", "--chat", "Hi"])
    assert plain.strip() and capsys.readouterr().out.strip()


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--model", "/no/such/checkpoint", "hello"],
        ["engine", "--model", "/no/such/checkpoint"],
        ["train", "init-checkpoint", "/tmp/unused", "--shape", "/no/such/shape.json"],
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
        main([*GENERATE, str(random_checkpoint), "--max-model-len", "8", "x " * 20])
    assert e.value.code == 2 and "maximum context length" in capsys.readouterr().err


@pytest.mark.usefixtures("any_dtype_native")
def test_generate_in_bfloat16(random_checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    args = [*GENERATE, str(random_checkpoint), "--max-tokens", "3"]
    main([*args, "--dtype", "bfloat16", "--kv-cache-dtype", "auto", "def main():"])
    assert capsys.readouterr().out.strip()


def test_a_dtype_the_cpu_lacks_is_one_line(
    random_checkpoint: Path, capsys: pytest.CaptureFixture, no_native_float16: None
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(random_checkpoint), "--dtype", "float16", "hi"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "float16" in err
