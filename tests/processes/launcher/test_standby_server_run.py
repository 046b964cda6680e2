"""The standby process on its own: a real standby forks real workers from scripts written
here; what a worker sees and how it ends must match a fresh ``python -u``."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastictrain.launcher.standby.client import (
    Standby,
    StandbyProcess,
    StandbyUnavailable,
)
from tests.helpers import pid_alive, wait_for

# Cheap modules, so each test's standby is ready in well under a second.
PRELOAD = ("json", "no_such_module_for_the_standby", "json.no_such_submodule")
@pytest.fixture
def standby() -> Iterator[Standby]:
    server = Standby(PRELOAD, ready_timeout_s=60)
    server.start()
    try:
        yield server
    finally:
        server.close()
        assert server.pid is not None and not pid_alive(server.pid)


def script(tmp_path: Path, body: str, name: str = "job.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def spawn(standby: Standby, tmp_path: Path, *argv: str,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -u ARGV`` through the standby; its exit code and output."""
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    proc = standby.spawn(["-u", *argv], env if env is not None else dict(os.environ),
                         str(out), str(err))
    code = proc.wait(timeout=60)
    return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())


@pytest.mark.processes
def test_ready_reports_what_it_imported_and_what_failed(standby: Standby) -> None:
    assert standby.ready()
    assert standby.info["preload_s"] >= 0
    # Not installed at all: an optional library; installed but broken: a failure.
    assert standby.info["absent"] == ["no_such_module_for_the_standby"]
    assert list(standby.info["failed"]) == ["json.no_such_submodule"]
    assert "ModuleNotFoundError" in standby.info["failed"]["json.no_such_submodule"]


@pytest.mark.processes
def test_a_worker_sees_what_a_fresh_interpreter_would(standby: Standby, tmp_path: Path) -> None:
    (tmp_path / "sibling.py").write_text("VALUE = 'from the script dir'\n")
    job = script(tmp_path, """
        import os, sys
        import sibling
        print(__name__, sys.argv[1:], os.getcwd(), sibling.VALUE)
        print(os.environ.get("ONLY_IN_REQUEST"), os.environ.get("ONLY_IN_AGENT"))
        print(open(f"/proc/{os.getpid()}/cmdline", "rb").read().decode())
        print(os.getsid(0) == os.getpid())
        print(b"PATH=" in open(f"/proc/{os.getpid()}/environ", "rb").read())
    """)
    env = {"PATH": os.environ["PATH"], "ONLY_IN_REQUEST": "yes"}
    os.environ["ONLY_IN_AGENT"] = "leak"
    try:
        result = spawn(standby, tmp_path, str(job), "a", "b", env=env)
    finally:
        del os.environ["ONLY_IN_AGENT"]
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"__main__ ['a', 'b'] {os.getcwd()} from the script dir"
    assert lines[1] == "yes None"  # exactly the environment asked for
    assert f"-u {job} a b" in lines[2]  # its own command line, not the standby's
    assert lines[3] == "True"  # its own session, as torchrun's Popen gives
    # /proc/<pid>/environ still holds an environment (the standby's), not a title:
    # elastictrain chaos finds a job's processes by a variable there.
    assert lines[4] == "True"


@pytest.mark.processes
def test_a_module_runs_as_main(standby: Standby, tmp_path: Path) -> None:
    result = spawn(standby, tmp_path, "-m", "json.tool", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and "json.tool" in result.stdout


@pytest.mark.processes
@pytest.mark.parametrize(("body", "code"), [
    ("import sys; sys.exit(75)", 75),
    ("import sys; sys.exit()", 0),
    ("import sys; sys.exit('bad config')", 1),
    ("raise RuntimeError('planted')", 1),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
    ("raise KeyboardInterrupt", -signal.SIGINT),
])
def test_exit_codes_are_the_interpreters(standby: Standby, tmp_path: Path, body: str,
                                         code: int) -> None:
    fresh = subprocess.run([sys.executable, "-u", "-c", body], capture_output=True,
                           text=True, check=False)
    result = spawn(standby, tmp_path, str(script(tmp_path, body)))
    assert result.returncode == fresh.returncode == code
    if "planted" in body:
        assert "RuntimeError: planted" in result.stderr
    if "bad config" in body:
        assert result.stderr.strip() == "bad config"


@pytest.mark.processes
def test_exit_waits_for_threads_and_runs_atexit(standby: Standby, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    job = script(tmp_path, f"""
        import atexit, threading, time
        def late():
            time.sleep(0.3)
            open({str(marker)!r}, "a").write("thread ")
        threading.Thread(target=late).start()
        atexit.register(lambda: open({str(marker)!r}, "a").write("atexit"))
        print("main done")
    """)
    result = spawn(standby, tmp_path, str(job))
    assert result.returncode == 0, result.stderr
    assert marker.read_text() == "thread atexit"  # thread joined first, as at exit


@pytest.mark.processes
def test_forked_workers_do_not_share_random_state(standby: Standby, tmp_path: Path) -> None:
    job = script(tmp_path, "import random; print(random.getrandbits(64))")
    first = spawn(standby, tmp_path, str(job)).stdout
    second = spawn(standby, tmp_path, str(job)).stdout
    assert first and first != second


def start_a_sleeper(standby: Standby, tmp_path: Path) -> tuple[Path, StandbyProcess]:
    """A worker that says it started, then sleeps until killed."""
    ready = tmp_path / "ready"
    job = script(tmp_path, f"""
        import time
        open({str(ready)!r}, "w").close()
        time.sleep(600)
    """)
    proc = standby.spawn(["-u", str(job)], dict(os.environ), None, None)
    wait_for(ready.exists, 60, "the worker to start")
    return job, proc


@pytest.mark.processes
def test_a_worker_killed_by_the_agent_reports_the_signal(standby: Standby,
                                                         tmp_path: Path) -> None:
    _, proc = start_a_sleeper(standby, tmp_path)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.processes
def test_standby_lost_while_a_worker_runs(standby: Standby, tmp_path: Path) -> None:
    """Killed under a running worker: the worker goes on, its end is still seen (with
    its true code: it re-parented to us, the subreaper), and new workers are refused
    so the agent uses Popen."""
    job, proc = start_a_sleeper(standby, tmp_path)
    assert standby.pid is not None
    os.kill(standby.pid, signal.SIGKILL)
    with pytest.raises(StandbyUnavailable):
        standby.spawn(["-u", str(job)], dict(os.environ), None, None)
    assert not standby.ready()
    assert pid_alive(proc.pid) and proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.processes
def test_a_standby_that_dies_in_its_imports_is_not_ready(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dies_on_import.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    server = Standby(("json", "dies_on_import"), ready_timeout_s=60)
    server.start()
    try:
        assert not server.ready()
        assert server.info["reason"]
        with pytest.raises(StandbyUnavailable):
            server.spawn(["-u", "x.py"], {}, None, None)
    finally:
        server.close()


@pytest.mark.processes
def test_notices_to_the_whole_job_leave_the_standby_serving(standby: Standby,
                                                            tmp_path: Path) -> None:
    """Slurm signals every process of a step: the standby ignores notices, its workers
    get a new interpreter's dispositions back."""
    assert standby.ready() and standby.pid is not None
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        os.kill(standby.pid, sig)
    job = script(tmp_path, """
        import signal
        print(signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL,
              signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
              signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    """)
    result = spawn(standby, tmp_path, str(job))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "True"]
    assert pid_alive(standby.pid)


@pytest.mark.processes
def test_torch_threads_follow_the_workers_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch read OMP_NUM_THREADS when the standby imported it; a worker launched with
    another value gets the thread count a fresh interpreter would."""
    job = script(tmp_path, "import torch; print(torch.get_num_threads())")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    fresh = subprocess.run([sys.executable, str(job)], env=env, capture_output=True,
                           text=True, check=True).stdout
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the standby imports without it
    server = Standby(("torch",), ready_timeout_s=120)
    server.start()
    try:
        ambient = dict(os.environ)
        assert spawn(server, tmp_path, str(job), env=env).stdout == fresh == "1\n"
        assert spawn(server, tmp_path, str(job), env=ambient).returncode == 0
    finally:
        server.close()


@pytest.mark.processes
def test_an_excepthook_that_exits_sets_the_code(standby: Standby, tmp_path: Path) -> None:
    """elastictrain's own hook turns a fatal error into exit 78 by raising SystemExit."""
    body = """
        import sys
        def hook(kind, value, tb):
            print("hook saw", value, file=sys.stderr)
            raise SystemExit(78)
        sys.excepthook = hook
        raise RuntimeError("planted")
    """
    job = script(tmp_path, body)
    fresh = subprocess.run([sys.executable, "-u", str(job)], capture_output=True, text=True,
                           check=False)
    result = spawn(standby, tmp_path, str(job))
    assert result.returncode == fresh.returncode == 78
    assert result.stderr == fresh.stderr == "hook saw planted\n"


@pytest.mark.processes
@pytest.mark.parametrize("ending", ["", "raise RuntimeError('planted')"])
def test_the_scripts_objects_live_until_the_interpreter_finalizes(
        standby: Standby, tmp_path: Path, ending: str) -> None:
    """As in a fresh interpreter, what the script built is torn down after ``atexit``,
    while finalizing: torn down earlier, a DDP model's gloo process group deadlocked
    in its destructor with its own thread (about one worker exit in 30 hung)."""
    # The check lives in another module: a function of the script's own would keep the
    # script's globals alive through its __globals__.
    (tmp_path / "checker.py").write_text(
        "def report(ref):\n    print('alive at atexit:', ref() is not None)\n")
    job = script(tmp_path, f"""
        import atexit, weakref
        import checker
        class Held:
            pass
        held = Held()
        atexit.register(checker.report, weakref.ref(held))
        {ending}
    """)
    fresh = subprocess.run([sys.executable, "-u", str(job)], capture_output=True, text=True,
                           check=False)
    result = spawn(standby, tmp_path, str(job))
    assert result.returncode == fresh.returncode
    assert result.stdout.splitlines()[0] == fresh.stdout.splitlines()[0] == \
        "alive at atexit: True"


def _processes_running(path: Path) -> list[int]:
    """Live processes whose command line names ``path`` (a worker's title is its command)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if str(path).encode() in cmdline and pid_alive(int(entry)):
                found.append(int(entry))
    return found


SLEEPER = """
    import time
    time.sleep(120)
"""
@pytest.mark.processes
def test_a_notice_while_the_standby_forks_a_worker_stops_that_worker(
        standby: Standby, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's handler raises ``SignalException`` while the agent waits for the
    standby's answer: the worker it forked meanwhile has no holder to stop it, so the
    client stops it before the exception goes on."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    job = script(tmp_path, SLEEPER, "sleeper.py")
    assert standby.ready()
    real_read = standby._read
    calls = []

    def notice_first(timeout_s: float) -> bool:
        calls.append(timeout_s)
        if len(calls) == 1:  # the notice arrives while the answer is awaited
            raise SignalException("SIGTERM", signal.SIGTERM)
        return real_read(timeout_s)

    monkeypatch.setattr(standby, "_read", notice_first)
    with pytest.raises(SignalException):
        standby.spawn(["-u", str(job)], dict(os.environ), None, None)
    monkeypatch.undo()
    # The standby reports every fork's end: this one's, killed, comes at once.
    number = standby._next

    def reported() -> bool:
        return number in standby._exits or (standby._read(0.05) and number in standby._exits)

    wait_for(reported, 30, "the interrupted worker's end")
    assert standby._exits[number] == -signal.SIGKILL
    assert not _processes_running(job)
    # The standby still serves.
    assert spawn(standby, tmp_path, str(script(tmp_path, "print('ok')"))).stdout == "ok\n"


@pytest.mark.processes
def test_a_notice_between_two_workers_of_a_group_stops_the_first(
        standby: Standby, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The notice comes after the standby forked local rank 0 and before rank 1: the
    context never held rank 0, so it stops it itself before the exception goes on."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException

    from elastictrain.launcher.standby.context import StandbyContext

    job = script(tmp_path, SLEEPER, "sleeper.py")
    real_spawn = standby.spawn
    spawned = []

    def notice_second(*args: object) -> StandbyProcess:
        if spawned:
            raise SignalException("SIGTERM", signal.SIGTERM)
        spawned.append(real_spawn(*args))  # type: ignore[arg-type]
        return spawned[-1]

    monkeypatch.setattr(standby, "spawn", notice_second)
    context = StandbyContext(standby, name="trainer", entrypoint=sys.executable,
                             args={0: ("-u", str(job)), 1: ("-u", str(job))},
                             envs={0: {}, 1: {}},
                             logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    with pytest.raises(SignalException):
        context.start()
    assert len(spawned) == 1 and spawned[0].poll() is not None
    assert not _processes_running(job)


