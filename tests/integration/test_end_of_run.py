"""The end of a run says where its outputs are and how to go on from them, naming paths that exist."""

from __future__ import annotations

import os
import re
from pathlib import Path

from trainer_utils import TINY

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
