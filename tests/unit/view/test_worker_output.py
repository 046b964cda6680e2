"""The workers' own output in `elastictrain run`'s live view, without a job: which files
and ranks are read, what is left out (our events, earlier launches' lines), the
``--view-ranks`` option, and the failing worker's traceback under its line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastictrain.core.errors import ConfigError
from elastictrain.launcher.launch import view_output_ranks
from elastictrain.launcher.run_args import take_view_ranks
from elastictrain.view.model import RunState
from elastictrain.view.output import OutputTail, parse_ranks


def write(log_dir: Path, attempt: int, rank: int, stream: str, text: str) -> Path:
    path = log_dir / "run_abc" / f"attempt_{attempt}" / str(rank) / f"{stream}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as file:
        file.write(text)
    return path


def test_new_lines_of_the_chosen_ranks_each_prefixed_by_its_rank(tmp_path: Path) -> None:
    tail = OutputTail(tmp_path, frozenset({0}))
    write(tmp_path, 0, 0, "stdout", "loading data\nepoch 1")
    write(tmp_path, 0, 1, "stdout", "rank 1 here\n")
    event = json.dumps({"event": "worker.start", "rank": 0})
    write(tmp_path, 0, 0, "stderr", f"{event}\nUserWarning: careful\n")
    assert sorted(tail.poll()) == ["[rank 0] UserWarning: careful", "[rank 0] loading data"]
    write(tmp_path, 0, 0, "stdout", " done\n")  # the line being written, now whole
    assert tail.poll() == ["[rank 0] epoch 1 done"]
    write(tmp_path, 1, 0, "stdout", "attempt 1\nno newline yet")  # a restart's files
    assert tail.poll() == ["[rank 0] attempt 1"]
    assert tail.poll(final=True) == ["[rank 0] no newline yet"]


def test_an_earlier_launchs_lines_are_not_shown_again(tmp_path: Path) -> None:
    write(tmp_path, 0, 0, "stdout", "from the launch before\n")
    tail = OutputTail(tmp_path, None)
    assert tail.poll() == []
    write(tmp_path, 0, 0, "stdout", "new\n")
    write(tmp_path, 0, 3, "stdout", "rank 3\n")
    assert sorted(tail.poll()) == ["[rank 0] new", "[rank 3] rank 3"]


def test_no_rank_reads_nothing(tmp_path: Path) -> None:
    tail = OutputTail(tmp_path, frozenset())
    write(tmp_path, 0, 0, "stdout", "hidden\n")
    assert tail.poll() == []


@pytest.mark.parametrize(("spec", "ranks"), [
    ("0", frozenset({0})), ("0,1", frozenset({0, 1})), (" 2, 3 ", frozenset({2, 3})),
    ("all", None), ("ALL", None), ("none", frozenset()),
])
def test_view_ranks_values(spec: str, ranks: frozenset[int] | None) -> None:
    assert parse_ranks(spec) == ranks


@pytest.mark.parametrize("spec", ["", "x", "-1", "0,a", ","])
def test_a_bad_view_ranks_value_is_a_usage_error(spec: str) -> None:
    with pytest.raises(ConfigError, match="--view-ranks"):
        view_output_ranks(spec)


def test_view_ranks_is_taken_from_the_launcher_options_only() -> None:
    assert take_view_ranks(["--view-ranks", "0,1", "--nproc-per-node=2", "train.py",
                            "--view-ranks", "3"]) == (
        "0,1", ["--nproc-per-node=2", "train.py", "--view-ranks", "3"])
    assert take_view_ranks(["--view-ranks=all", "train.py"]) == ("all", ["train.py"])
    assert take_view_ranks(["train.py"]) == ("0", ["train.py"])


def _failed(rank: int, first: bool, **error: object) -> dict[str, object]:
    return {"event": "agent.worker_failed", "role": "agent", "ts": 1.0, "worker_rank": rank,
            "exit_code": 1, "meaning": "error", "first": first, **error}


def test_the_first_failure_shows_its_traceback_end_and_log_once() -> None:
    error = {"error": "ModuleNotFoundError", "where": "job.py:4", "before_init": True,
             "traceback": ['  File "job.py", line 4, in <module>', "    import tokenizers",
                           "ModuleNotFoundError: No module named 'tokenizers'"],
             "output_file": "logs/run_abc/attempt_0/0/stderr.log"}
    state = RunState()
    state.apply(_failed(0, True, **error))
    state.apply(_failed(1, False, **error))  # stopped because rank 0 failed: one line
    state.apply(_failed(0, True, **error))  # the next attempt, the same error
    texts = [line.text for line in state.lines]
    assert texts[0].splitlines() == [
        "worker rank 0 exited 1 (error): ModuleNotFoundError at job.py:4",
        '    File "job.py", line 4, in <module>', "      import tokenizers",
        "  ModuleNotFoundError: No module named 'tokenizers'",
        "  log: logs/run_abc/attempt_0/0/stderr.log"]
    assert texts[1] == "worker rank 1 exited 1 (error): ModuleNotFoundError at job.py:4"
    assert texts[2].endswith("at job.py:4 (the same error as before)")
