"""The demo's summary reads as meant: a run's duration never reads as a wait before a
resume, counts agree in number, and a value not known says so instead of ``None``."""

from __future__ import annotations

from elastictrain.demo.runner import DemoResult, human_summary


def _result(**changes: object) -> DemoResult:
    fields: dict[str, object] = {
        "final_step": 30, "restarts": 1, "resumed_from": [None, 20], "committed_steps": [20],
        "lost_steps": 2, "final_loss": 2.5, "param_digest": "ab", "exit_code": 0,
        "storage": "./s", "events_dir": "./s/events/x", "wall_s": 11.2, **changes}
    return DemoResult(**fields)  # type: ignore[arg-type]


def test_a_finished_run_keeps_the_form_ci_reads() -> None:
    lines = human_summary(_result()).splitlines()
    assert lines[0] == "elastictrain demo: finished in 11.2s (exit 0)"
    assert "attempts:           2 (1 restart)" in lines[1]


def test_an_interrupted_run_says_its_duration_before_what_to_do() -> None:
    text = human_summary(_result(interrupted="SIGINT", final_snapshot=81, exit_code=75,
                                 final_step=None, final_loss=None, restarts=0))
    first = text.splitlines()[0]
    assert first == ("elastictrain demo: after 11.2s, exit 75: interrupted (SIGINT): final "
                     "snapshot at step 81 committed; resume with the same command")
    assert "attempts:           1 (0 restarts)" in text
    assert "final step / loss:  unknown / unknown" in text and "None" not in text


def test_a_final_snapshot_committed_before_a_second_ctrl_c_is_still_said() -> None:
    """The view said "final snapshot of step 81 committed"; a second Ctrl-C then killed
    the job (exit 130): the summary must not say there is no final snapshot."""
    text = human_summary(_result(interrupted="SIGINT", final_snapshot=81, exit_code=130))
    assert "no final snapshot" not in text
    assert ("interrupted (SIGINT): final snapshot at step 81 committed, then the job was "
            "killed; resume with the same command") in text
