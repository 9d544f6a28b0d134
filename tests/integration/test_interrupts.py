"""Interrupts are interrupts (issue 43): Ctrl-C (SIGINT) in training stops like SIGTERM (the step finished, a
checkpoint saved with its checksums, exit 0, no traceback); a second Ctrl-C stops at once with one line and
leaves no partial ``step-N.tmp``; an interrupt while a resume loads its checkpoint ends the job (nothing written)
and is never taken for damage: the good step is neither reported unreadable nor moved aside. Each test asserts
the line, the exit code and that every earlier file is unchanged (checksums); the signals are real ones, sent
to a real one-process CPU run (from outside it, or from within it where two must arrive as two). A tool started
with SIGINT ignored (a background job of a script) still stops on Ctrl-C; a caller's own handler is kept."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer_utils import CKPT_EVERY_2, REPO, TINY, file_checksums

from torchtitan_ext.errors import EXIT_INTERRUPTED
from torchtitan_ext.train.__main__ import main

pytestmark = pytest.mark.usefixtures("restore_signal_handlers")


def _start(dump: Path, *overrides: str) -> subprocess.Popen:
    """A long one-process run (checkpoints every 2 steps), its output read line by line; its stderr goes to a
    file beside ``dump`` (a pipe nobody reads until the end could fill and stop the run)."""
    cmd = [sys.executable, "-m", "torchtitan_ext.train", *TINY, "--job.dump_folder", str(dump), *CKPT_EVERY_2,
           "--training.steps", "1000", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RANK", None)
    dump.parent.mkdir(parents=True, exist_ok=True)
    with open(dump.parent / "stderr.log", "w") as stderr:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)


def _wait_for_step(proc: subprocess.Popen, step: int) -> list[str]:
    lines = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"the run ended before step {step}: {''.join(lines)[-2000:]}"
        lines.append(line)
        if line.startswith(f"step {step:6d} "):
            return lines
    raise AssertionError("timed out")


def _finish(proc: subprocess.Popen, dump: Path) -> tuple[int, str, str]:
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out, (dump.parent / "stderr.log").read_text()


def test_ctrl_c_in_training_finishes_the_step_saves_and_exits_0(tmp_path):
    dump = tmp_path / "run"
    proc = _start(dump)
    try:
        _wait_for_step(proc, 3)  # step-2 is published (synchronous save) before step 3 is logged
        before = file_checksums(dump / "checkpoint")
        proc.send_signal(signal.SIGINT)
        code, out, err = _finish(proc, dump)
    finally:
        proc.kill()
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    last = out.strip().splitlines()[-1]
    step = int(last.split("after step ")[1].split(":")[0])
    assert last.startswith(f"preempted (signal) after step {step}: saved {dump}/checkpoint/step-{step}; exiting"), last
    assert step >= 3 and (dump / "checkpoint" / f"step-{step}" / "checksums.json").is_file()
    assert not list((dump / "checkpoint").glob("*.tmp"))
    after = file_checksums(dump / "checkpoint")
    assert all(after.get(k) == v for k, v in before.items())  # step-2 as it was


def _run(capsys, dump: Path, *overrides: str) -> tuple[int, str, str]:
    os.environ.pop("RANK", None)
    code = main([*TINY, "--job.dump_folder", str(dump), *overrides])
    out, err = capsys.readouterr()
    return code, out, err


def test_second_ctrl_c_stops_at_once_with_one_line(tmp_path, capsys, monkeypatch):
    """Two real SIGINTs to this process while step 4's checkpoint is being written: the first asks for a stop,
    the second ends the job inside the save. Sent from within the run, because two signals sent from outside
    while the main thread sits in one long C call (a backward) reach Python's handler as one: the subprocess
    version of this test then saw an ordinary stop (exit 0) on a loaded CI machine."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    dump = tmp_path / "run"
    write = FileSystemWriter.write_data
    before: dict[str, str] = {}

    def ctrl_c_twice_then_write(self, plan, planner):
        if Path(self.path).name == "step-4.tmp":
            before.update(file_checksums(dump / "checkpoint" / "step-2"))
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs here, between the two calls: a stop request
            os.kill(os.getpid(), signal.SIGINT)  # ... and this one raises at once
        return write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", ctrl_c_twice_then_write)
    code, out, err = _run(capsys, dump, *CKPT_EVERY_2, "--training.steps", "6")
    assert code == EXIT_INTERRUPTED, out[-2000:] + err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert out.strip().splitlines()[-1] == ("interrupted again (SIGINT): stopping at once, without finishing the "
                                            "step or saving; a resume starts from the last published checkpoint")
    assert before, "step 4's save never began"
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]  # no step-4, no partial .tmp
    assert file_checksums(dump / "checkpoint" / "step-2") == before


def test_ctrl_c_while_loading_a_checkpoint_ends_the_job_and_never_blames_it(checkpointed_run, tmp_path, capsys,
                                                                             monkeypatch):
    """A real SIGINT to this process while DCP reads step-4's data (the handler set by the run is in place)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    dump = shutil.copytree(checkpointed_run, tmp_path / "run")
    before = file_checksums(dump)
    read = FileSystemReader.read_data

    def interrupt_then_read(self, plan, planner):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        return read(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", interrupt_then_read)
    code, out, err = _run(capsys, dump, *CKPT_EVERY_2, "--training.steps", "6")
    assert code == 0 and "Traceback" not in err and not [x for x in err.splitlines() if x.startswith("error:")]
    assert "preempted (SIGINT) during start-up or resume: nothing written; exiting" in out
    assert "unreadable" not in out and "step      5" not in out
    assert file_checksums(dump) == before  # step-4 neither moved aside nor changed; nothing written


def test_keyboard_interrupt_inside_a_load_is_not_damage(checkpointed_run, tmp_path, capsys, monkeypatch):
    """Where no handler turns Ctrl-C into a flag, the KeyboardInterrupt DCP wraps in its CheckpointException is
    raised as itself and ends the tool with one line and exit code 130: before, the good step-4 was reported
    unreadable, moved aside, and the run trained on."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    import torchtitan_ext.train.preemption as preemption

    dump = shutil.copytree(checkpointed_run, tmp_path / "run")
    before = file_checksums(dump)

    def interrupted(self, plan, planner):
        raise KeyboardInterrupt

    monkeypatch.setattr(FileSystemReader, "read_data", interrupted)
    monkeypatch.setattr(preemption, "SIGNALS", (signal.SIGTERM, signal.SIGUSR1))  # Ctrl-C left to Python
    code, out, err = _run(capsys, dump, *CKPT_EVERY_2, "--training.steps", "6")
    assert code == EXIT_INTERRUPTED  # the tool's boundary: one line, never a traceback
    assert err.strip().splitlines()[-1] == "error: interrupted (SIGINT): stopped at once"
    assert "unreadable" not in out + err and "moved" not in out + err
    assert file_checksums(dump) == before


def test_an_in_process_run_puts_the_signal_handlers_back(tmp_path, capsys):
    """A run called in process leaves the caller's handlers as they were: a stop-request handler left behind
    was inherited by a process forked later (data.prepare's pool workers), which then outlived SIGTERM."""

    def callers(signum, frame):
        pass

    signal.signal(signal.SIGTERM, callers)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    before_int = signal.getsignal(signal.SIGINT)
    code, out, err = _run(capsys, tmp_path / "run", "--training.steps", "2")
    assert code == 0, err[-3000:]
    assert signal.getsignal(signal.SIGTERM) is callers
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is before_int


def _interrupted_work(*args, **kwargs) -> int:
    """A tool's work that Ctrl-C reaches (a real SIGINT to this process); 0 when the signal did nothing."""
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(200):
        time.sleep(0.01)
    return 0


def _must_be_interrupted(*args, **kwargs) -> int:
    _interrupted_work()
    raise AssertionError("the SIGINT was lost: the work ran to its end")


@pytest.mark.parametrize("entry", ["run_tool", "launch"])
def test_a_tool_started_with_sigint_ignored_still_stops_on_ctrl_c(capsys, monkeypatch, entry):
    """A process started with SIGINT ignored (a background job of a script, ``cmd &``) inherits SIG_IGN, and
    Python then installs no ``KeyboardInterrupt`` handler: every tool ran through a Ctrl-C to the end. The entry
    points take SIGINT over while they run: one line, exit 130, and SIG_IGN is put back afterwards."""
    from torchtitan_ext import cli
    from torchtitan_ext.tools import launch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if entry == "run_tool":
        code = cli.run_tool(_must_be_interrupted, [])
    else:  # the launcher's check of the job, before it hands the signal to the workers
        monkeypatch.setattr(launch, "preflight", _must_be_interrupted)
        code = launch.main(["--config", "unused.toml"])
    assert code == EXIT_INTERRUPTED
    assert capsys.readouterr().err.splitlines() == ["error: interrupted (SIGINT): stopped at once"]
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_a_callers_sigint_handler_is_left_in_place(capsys):
    """A tool called in process with a handler of the caller's in place: the caller's handler gets the signal."""
    from torchtitan_ext import cli

    received = []

    def callers(signum, frame):
        received.append(signum)

    signal.signal(signal.SIGINT, callers)
    assert cli.run_tool(_interrupted_work, []) == 0
    assert received == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is callers
