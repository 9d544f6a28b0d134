"""Issue 44: SFT has a documented command, a config (train_configs/sft_debug.toml) and sample conversations in
the repository (torchtitan_ext/data/samples/). The config as written, from the shared tiny pretrained run (byte
tokens instead of the default job's BPE, 20 steps): the loss on the assistant's tokens falls and the held-out
conversations are evaluated. In-process through the entry point, from the repository root as documented."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from trainer_utils import REPO, TEST_CACHE, read_metrics

from torchtitan_ext.train.__main__ import main

pytestmark = pytest.mark.usefixtures("restore_signal_handlers")


def test_sft_debug_config_fine_tunes_the_sample_conversations(checkpointed_run, tmp_path, monkeypatch, capsys):
    os.environ.pop("RANK", None)
    monkeypatch.chdir(REPO)  # the config's data paths are the repository's
    code = main(["--config", "train_configs/sft_debug.toml", "--data.tokenizer", "byte", "--data.cache_dir",
                 str(TEST_CACHE), "--checkpoint.initial_load_path", str(checkpointed_run), "--job.dump_folder",
                 str(tmp_path / "sft"), "--training.steps", "20", "--metrics.log_freq", "1",
                 "--metrics.tensorboard", "false"])
    out = capsys.readouterr().out
    assert code == 0 and f"initial weights from {checkpointed_run / 'checkpoint' / 'step-4'}" in out, out[-2000:]
    assert "chat data: 54 conversations" in out and "chat data: 18 conversations" in out
    records = read_metrics(tmp_path / "sft")
    loss = {r["step"]: r["loss"] for r in records}
    assert np.mean([loss[s] for s in range(16, 21)]) < 0.6 * loss[1], loss
    val = [r["val_loss"] for r in map(json.loads, (tmp_path / "sft" / "metrics.jsonl").read_text()
                                      .splitlines()) if "val_loss" in r]
    assert len(val) == 1 and np.isfinite(val[0])
