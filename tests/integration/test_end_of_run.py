"""The end of a run says where its outputs are and how to go on from them, naming paths that exist."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from trainer_utils import TINY, file_checksums

from torchtitan_ext.train.__main__ import main


def test_run_ends_naming_its_outputs_and_the_next_commands(tmp_path, capsys):
    os.environ.pop("RANK", None)
    dump = tmp_path / "run"
    assert main([*TINY, "--job.dump_folder", str(dump), "--training.steps", "2", "--checkpoint.enabled", "true",
                 "--checkpoint.interval", "2", "--metrics.tensorboard", "true"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-4:]
    assert last[0].startswith(f"done: step 2; outputs in {dump}: checkpoints {dump / 'checkpoint'}, metrics ")
    named = re.findall(r"(?:checkpoints|metrics|TensorBoard|logs) (\S+)", last[0])
    assert len(named) == 4 and all(Path(p.rstrip(",")).exists() for p in named), last[0]
    assert (dump / "checkpoint" / "step-2").is_dir()
    assert last[1] == f"  go on: the same command with a larger --training.steps resumes from {dump / 'checkpoint'}"
    assert last[2] == f"  evaluate: python -m torchtitan_ext.eval --config {dump / 'config.toml'}"
    assert (dump / "config.toml").is_file()
    assert last[3] == f"  export: python -m torchtitan_ext.export --checkpoint {dump} --output <new folder>"


def test_rerunning_a_finished_run_says_nothing_to_train_and_writes_nothing(tmp_path, capsys):
    """The run's last step was saved and validated: the same command again ends with one line and exit 0,
    without validating again (no second val_loss record for that step, no new TensorBoard event file)."""
    os.environ.pop("RANK", None)
    dump = tmp_path / "run"
    args = [*TINY, "--job.dump_folder", str(dump), "--training.steps", "2", "--checkpoint.enabled", "true",
            "--checkpoint.interval", "2", "--metrics.tensorboard", "true", "--eval.steps", "2"]
    assert main(args) == 0
    capsys.readouterr()
    before = file_checksums(dump)
    assert [r["step"] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())
            if "val_loss" in r] == [2]
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == ("nothing to train: resumed at step 2 and training.steps = 2 (raise training.steps to "
                       "continue); nothing written"), out
    assert not [line for line in out if line.startswith("validation")]
    assert file_checksums(dump) == before  # metrics.jsonl, tb/, run.json and the checkpoint as they were
