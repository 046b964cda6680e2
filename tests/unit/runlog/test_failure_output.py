"""A worker's error read from its output (it failed before ``et.init()``), recorded by
the standby's catch, and the summary's lines for it."""

from __future__ import annotations

import json
from pathlib import Path

from elastictrain.runlog.failure import error_from_output, failure_lines, record_uncaught

OUTPUT = """\
hello from rank 0
Traceback (most recent call last):
  File "/opt/et/launcher/standby/server.py", line 247, in run_python
    _LEFT_BEHIND.append(runpy.run_path(args[0], run_name="__main__"))
                        ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "<frozen runpy>", line 291, in run_path
  File "train.py", line 4, in <module>
    import tokenizers
ModuleNotFoundError: No module named 'tokenizers'
"""


def test_the_last_traceback_of_the_output_is_the_error() -> None:
    assert error_from_output(OUTPUT) == {
        "error": "ModuleNotFoundError", "message": "No module named 'tokenizers'",
        "where": "train.py:4", "failed_step": None, "before_init": True,
        "traceback": ['  File "train.py", line 4, in <module>', "    import tokenizers",
                      "ModuleNotFoundError: No module named 'tokenizers'"]}


def test_a_chained_a_dotted_and_a_syntax_error() -> None:
    chained = OUTPUT + ("\nDuring handling of the above exception, another exception "
                        "occurred:\n\nTraceback (most recent call last):\n"
                        '  File "train.py", line 6, in <module>\n'
                        "    raise pkg.errors.SetupFailed('no tokenizer')\n"
                        "pkg.errors.SetupFailed: no tokenizer\n")
    found = error_from_output(chained)
    assert found is not None
    assert (found["error"], found["where"], found["message"]) == (
        "SetupFailed", "train.py:6", "no tokenizer")
    syntax = ('Traceback (most recent call last):\n  File "train.py", line 3\n'
              "    def f(:\n          ^\nSyntaxError: invalid syntax\n")
    found = error_from_output(syntax)
    assert found is not None and found["where"] == "train.py:3"
    assert found["traceback"] == ['  File "train.py", line 3', "    def f(:",
                                  "SyntaxError: invalid syntax"]


def test_output_without_a_traceback_names_no_error() -> None:
    assert error_from_output("") is None
    assert error_from_output("step 10 loss 0.3\nkilled\n") is None
    assert error_from_output("Traceback (most recent call last):\n") is None  # cut short


def test_the_summary_of_a_failure_before_init() -> None:
    error = {**(error_from_output(OUTPUT) or {}), "worker_rank": 1,
             "output_file": "logs/attempt_1/1/stderr.log"}
    lines = failure_lines(error, crash_loop=2)
    assert lines[:4] == [
        "  error:           ModuleNotFoundError: No module named 'tokenizers'",
        "    raised at:     train.py:4 (rank 1, before elastictrain.init())",
        '                     File "train.py", line 4, in <module>',
        "                       import tokenizers"]
    assert "    worker log:    logs/attempt_1/1/stderr.log" in lines
    assert any("the same error at the same place before any step in 2 attempts" in line
               for line in lines)
    no_file = failure_lines({**error, "output_file": None})
    assert any("not in a file: the worker wrote to the launcher's stderr" in line
               for line in no_file)


def test_an_uncaught_error_is_recorded_in_torchs_error_file_format(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    try:
        import no_such_module_in_this_test  # noqa: F401
    except ModuleNotFoundError as exc:
        record_uncaught(str(path), exc, exc.__traceback__)
    data = json.loads(path.read_text())
    assert data["message"]["message"] == (
        "ModuleNotFoundError: No module named 'no_such_module_in_this_test'")
    assert "Traceback (most recent call last)" in data["message"]["extraInfo"]["py_callstack"]
    ours = data["elastictrain"]
    assert ours["before_init"] is True and ours["where"].startswith(f"{__file__}:")
    assert ours["error"] == "ModuleNotFoundError" and isinstance(ours["ts"], float)
    record_uncaught(None, ValueError("x"), None)  # not under torchrun: nothing to write
