"""Issue 44: ``mup.coord_check`` says its progress (a width takes minutes on a CPU) and a missing matplotlib is
one line naming the extra before anything runs, not after the check."""

from __future__ import annotations

import re
import sys

from test_mup import CHECK

from torchtitan_ext import mup
from torchtitan_ext.mup.coord_check.__main__ import main as coord_check_main


def test_missing_matplotlib_is_one_line_before_the_check_runs(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr(mup, "run_coord_check", lambda *a: (_ for _ in ()).throw(AssertionError("ran")))
    assert coord_check_main([*CHECK, "--widths", "64,128", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: the coordinate-check plot needs matplotlib: pip install -e '.[scaling]' (or --plot '' "
                   "for the table alone)"]


def test_progress_lines_and_the_table_without_a_plot(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # --plot '': matplotlib is not needed
    monkeypatch.chdir(tmp_path)
    assert coord_check_main([*CHECK, "--widths", "64,128", "--steps", "2", "--plot", ""]) == 0
    out = capsys.readouterr().out
    progress = [line for line in out.splitlines() if "width" in line and "elapsed" in line]
    shapes = [re.sub(r"loss [\d.]+", "loss L", re.sub(r"elapsed \d+ s", "elapsed T", line)) for line in progress]
    assert shapes == ["width 64 (1/2): 2 steps, elapsed T", "  width 64: step 1/2, loss L, elapsed T",
                      "  width 64: step 2/2, loss L, elapsed T", "width 128 (2/2): 2 steps, elapsed T",
                      "  width 128: step 1/2, loss L, elapsed T", "  width 128: step 2/2, loss L, elapsed T"]
    assert "coordinate check: parametrization" in out and "plot:" not in out and list(tmp_path.iterdir()) == []
