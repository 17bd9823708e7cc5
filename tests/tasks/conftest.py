"""The isolations the sandbox tests run under."""

import shutil

import pytest

from tasks.sandbox import ISOLATION_ENV

# unshare (util-linux) is on every Debian/Ubuntu base system; bubblewrap is optional. No
# isolation is skipped for being absent: where unshare cannot isolate, these tests fail.
PRESENT = ["unshare"] + (["bubblewrap"] if shutil.which("bwrap") else [])


@pytest.fixture(params=PRESENT)
def isolation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every run of the test under this isolation, chosen the way callers opt in: the env."""
    monkeypatch.setenv(ISOLATION_ENV, request.param)
    return request.param
