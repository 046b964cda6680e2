"""A mistyped command or option gets the closest one in its usage error (exit 2), from
the options of the subcommand the line named."""

from __future__ import annotations

import pytest

from elastictrain.cli import main
from elastictrain.core.errors import EXIT_USAGE


@pytest.mark.parametrize(("argv", "hint"), [
    (["stauts", "./ck"], "did you mean 'status'?"),
    (["snapshot", "list", "./ck"], "did you mean 'snapshots'?"),
    (["snapshots", "lst", "./ck"], "did you mean 'list'?"),
    (["demo", "--kil-at", "5"], "did you mean --kill-at?"),
    (["demo", "--stepz", "3"], "did you mean --steps?"),  # demo's, not inspect's --step
    (["status", "./ck", "--jsn"], "did you mean --json?"),
])
def test_a_typo_gets_the_closest_name(argv: list[str], hint: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_USAGE
    assert capsys.readouterr().err.rstrip().endswith(hint)


@pytest.mark.parametrize("argv", [["frobnicate"], ["demo", "--zzzzzz"]])
def test_nothing_close_is_no_guess(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_USAGE and "did you mean" not in capsys.readouterr().err
