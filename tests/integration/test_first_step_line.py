"""Issue 44: a new run is not silent for its first ``metrics.log_freq`` steps. The first step of a start is one
console line (as torchtitan logs step 1), saying when the next comes; metrics.jsonl keeps the log_freq
cadence its readers (benchmarks/*.py) expect. The job runs in-process through the entry point."""

from __future__ import annotations

import os

import pytest
from trainer_utils import TINY, read_metrics

from torchtitan_ext.train.__main__ import main

pytestmark = pytest.mark.usefixtures("restore_signal_handlers")


def test_first_step_is_said_and_metrics_jsonl_keeps_its_cadence(tmp_path, capsys):
    os.environ.pop("RANK", None)
    code = main([*TINY, "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "4",
                 "--metrics.log_freq", "3"])
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    assert code == 0 and [x.split()[1] for x in lines] == ["1", "3", "4"], lines
    assert lines[0].startswith("step      1  loss ") and " gnorm " in lines[0] and " lr " in lines[0]
    assert lines[0].endswith("(the next line at step 3: metrics.log_freq = 3)") and " tok/s " not in lines[0]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [3, 4]
