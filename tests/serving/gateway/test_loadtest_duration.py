"""`tierserve loadtest --duration` takes Locust's --run-time format (fast: no Locust run)."""

import pytest

from serving.cli import build_parser, command_modules
from serving.gateway.loadtest import parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("60s", 60), ("5m", 300), ("1h30m", 5400), ("2h", 7200), ("1h2m3s", 3723)],
)
def test_locust_durations_parse(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds
    assert (
        build_parser(command_modules()).parse_args(["loadtest", "--duration", text]).duration
        == seconds
    )


@pytest.mark.parametrize("junk", ["", "s", "0", "0m", "60x", "1.5", "-5", "5m1h", "1 h", "m5"])
def test_junk_durations_are_a_usage_error(junk: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser(command_modules()).parse_args(["loadtest", "--duration", junk])
    assert exited.value.code == 2
    assert f"invalid duration {junk.strip()!r}" in capsys.readouterr().err
