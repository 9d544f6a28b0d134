"""Resume diagnoses that name the cause (issue 43): a resume whose checkpoint is intact but does not fit the job
says which key changed since the last start (``<dump>/config.toml``; a model key left at the flavor's value is
said with the value the flavor gave, from run.json) and the value to set, instead of calling every checkpoint
unreadable and suggesting ``checkpoint.allow_fresh_start`` (which restarts from step 0). Each case asserts the
one line, exit code 2, and that every file is unchanged (checksums)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from trainer_utils import CKPT_EVERY_2, TINY, file_checksums

from torchtitan_ext.train.__main__ import main

pytestmark = pytest.mark.usefixtures("restore_signal_handlers")









def _refused(capsys, checkpointed_run: Path, tmp_path: Path, *overrides: str) -> tuple[Path, str]:
    """Resume a copy of ``checkpointed_run`` with ``overrides``: exit 2, one error line (returned), nothing trained or
    written, nothing moved aside."""
    dump = shutil.copytree(checkpointed_run, tmp_path / "run")
    before = file_checksums(dump)
    os.environ.pop("RANK", None)
    code = main([*TINY, "--job.dump_folder", str(dump), *CKPT_EVERY_2, "--training.steps", "6", *overrides])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert "unreadable" not in out + err and "allow_fresh_start" not in errors[0] and "step      5" not in out
    assert file_checksums(dump) == before
    return dump, errors[0]


def test_another_optimizer_is_named_not_unreadable(checkpointed_run, tmp_path, capsys):
    dump, line = _refused(capsys, checkpointed_run, tmp_path, "--optimizer.name", "muon")
    assert line.startswith(f"error: {dump}/checkpoint/step-4 is intact (checksums verified) but does not fit this "
                           f"job (RuntimeError: Missing key in checkpoint state_dict: optimizer.state."), line
    assert line.endswith('): optimizer.name changed since the last start ("adamw" -> "muon"): set optimizer.name '
                         '= "adamw" to resume it (or choose another job.dump_folder)'), line


def test_changed_model_field_names_the_key_and_the_flavor_value(checkpointed_run, tmp_path, capsys):
    dump, line = _refused(capsys, checkpointed_run, tmp_path, "--model.n_layers", "1")
    assert line == (f"error: {dump}/checkpoint/step-4: parameter layers.1.attention.k_norm.weight: checkpoint "
                    f"shape [64], model absent (33 parameters differ in all); model.n_layers changed since the last "
                    f"start (4 -> 1): set model.n_layers = 4 to resume it"), line


def test_float8_and_layout_changes_are_named(tmp_path):
    """float8 needs a GPU and a layout change several processes, so the diagnosis itself is checked here:
    the keys that shape a checkpoint's contents, from the previous start's config.toml, each with the value to
    set; keys that do not (training.steps) are not named."""
    from torchtitan_ext.checkpoint.manager import config_changes
    from torchtitan_ext.config.loader import parse_args, to_toml

    (tmp_path / "config.toml").write_text(to_toml(parse_args([])))
    now = parse_args(["--float8.enabled", "true", "--float8.recipe", "rowwise", "--parallelism.tp", "2",
                      "--training.steps", "7"])
    assert config_changes(tmp_path, now) == [
        "parallelism.tp changed since the last start (1 -> 2): set parallelism.tp = 1 to resume it",
        "float8.enabled changed since the last start (false -> true): set float8.enabled = false to resume it",
        'float8.recipe changed since the last start ("tensorwise" -> "rowwise"): set float8.recipe = "tensorwise" '
        'to resume it']
    assert config_changes(tmp_path / "absent", now) == []  # no previous config: nothing claimed
