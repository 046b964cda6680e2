"""The excepthook init() installs: an elastictrain error exits with its own code after
one event; other exceptions log ``worker.failed`` and reach the previous hook; both
leave the error in torchrun's error file for the agent; shutdown() restores the hook,
except while an error is on its way to it, and logs run.finished only for a clean end."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import pytest
from structlog.testing import capture_logs

from elastictrain import runtime
from elastictrain.core.errors import (
    ConfigError,
    ResumeMismatchError,
    StorageError,
    StoragePermissionError,
)
from elastictrain.worker import session


@pytest.fixture
def hook() -> Iterator[None]:
    original = sys.excepthook
    runtime._install_excepthook()
    try:
        yield
    finally:
        runtime._restore_excepthook()
        sys.excepthook = original


def _raised(exc: BaseException) -> tuple[type[BaseException], BaseException,
                                         TracebackType | None]:
    try:
        raise exc
    except BaseException as caught:
        return type(caught), caught, caught.__traceback__


@pytest.mark.parametrize(("error", "code"), [
    (ConfigError("snapshot.keep=0"), 78), (ResumeMismatchError("dataset length"), 78),
    (StoragePermissionError("read-only"), 78), (StorageError("timed out"), 1)])
def test_our_errors_exit_with_their_code_after_one_event(hook: None, error: Exception,
                                                         code: int) -> None:
    with capture_logs() as logs, pytest.raises(SystemExit) as exited:
        sys.excepthook(*_raised(error))
    assert exited.value.code == code
    assert [e["event"] for e in logs] == ["worker.error"]
    assert logs[0]["error"] == type(error).__name__
    assert logs[0]["message"] == str(error)
    assert logs[0]["exit_code"] == code and logs[0]["fatal"] == (code == 78)
    assert "test_exit_hook.py:" in logs[0]["where"]


def test_other_exceptions_go_to_the_previous_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[BaseException] = []
    original = sys.excepthook
    monkeypatch.setattr(sys, "excepthook", lambda t, v, tb: seen.append(v))
    runtime._install_excepthook()
    try:
        with capture_logs() as logs:
            sys.excepthook(*_raised(ValueError("user bug")))
    finally:
        runtime._restore_excepthook()
    assert [str(e) for e in seen] == ["user bug"]
    assert [e["event"] for e in logs] == ["worker.failed"]
    assert logs[0]["error"] == "ValueError" and logs[0]["message"] == "user bug"
    assert "test_exit_hook.py:" in logs[0]["where"]
    monkeypatch.setattr(sys, "excepthook", original)


def test_the_error_reaches_torchruns_error_file(hook: None, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    error_file = tmp_path / "attempt_0" / "0" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with capture_logs(), pytest.raises(SystemExit):
        sys.excepthook(*_raised(StorageError("read x/state.pt: timed out")))
    data = json.loads(error_file.read_text())
    # torch's own format (what torchrun's summary prints) and ours beside it.
    assert data["message"]["message"] == "StorageError: read x/state.pt: timed out"
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0
    ours = data["elastictrain"]
    assert (ours["error"], ours["message"]) == ("StorageError", "read x/state.pt: timed out")
    assert "test_exit_hook.py:" in ours["where"]
    # Written whole beside it, then renamed over it: nothing partial left behind.
    assert [p.name for p in error_file.parent.iterdir()] == ["error.json"]


class _Ctx:
    rank = 0


def test_run_finished_only_for_a_clean_end(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = session.Runtime.__new__(session.Runtime)
    rt.ctx, rt.finished = _Ctx(), False  # type: ignore[assignment]
    monkeypatch.setattr(session, "_current", rt)
    with capture_logs() as logs:
        try:
            raise RuntimeError("in the loop")
        except RuntimeError:
            session.log_finished(final_step=3)  # from a finally: not an end
        session.log_finished(final_step=5)
        session.log_finished(final_step=6)  # once
    assert [(e["event"], e["final_step"]) for e in logs] == [("run.finished", 5)]


def test_shutdown_restores_the_hook_unless_an_error_is_propagating(hook: None) -> None:
    with pytest.raises(ConfigError):
        try:
            raise ConfigError("bad")
        finally:
            runtime.shutdown()
    assert sys.excepthook is runtime.exit_on_error  # still there for the error above
    runtime.shutdown()
    assert sys.excepthook is not runtime.exit_on_error
