"""The scaling-law tool's sweep: a real grid of tiny runs trained and read back from their dump folders by the
fit."""

from __future__ import annotations

import json
import shutil

from trainer_utils import TINY

from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.models.flavors import resolve_model_args
from torchtitan_ext.models.param_count import count_params
from torchtitan_ext.scaling import read_dump
from torchtitan_ext.scaling.__main__ import main


def _metrics(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_sweep_trains_the_grid_and_fit_reads_the_dumps(tmp_path, capsys, monkeypatch):
    """2 widths x 3 budgets of tiny runs (byte tokenizer, 4 x 64 tokens a step); runs.csv, fit.json and fit.png;
    ``fit --runs`` reads the same N (count_params of the resolved model, vocabulary tables left out), D and
    final validation loss from the dump folders."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "sweep"
    assert main(["sweep", "--widths", "64", "128", "--tokens", "768", "1536", "2560", "--out", str(out), "--fit",
                 "--", *TINY, "--metrics.log_freq", "5", "--eval.steps", "2"]) == 0
    capsys.readouterr()
    lines = (out / "runs.csv").read_text().splitlines()
    assert lines[0] == "params,tokens,loss,run" and len(lines) == 7
    # Two runs at once: the same losses as one after another (each run is its own seeded process).
    assert main(["sweep", "--widths", "64", "--tokens", "768", "1536", "--out", str(tmp_path / "par"),
                 "--parallel", "2", "--", *TINY, "--metrics.log_freq", "5", "--eval.steps", "2"]) == 0
    capsys.readouterr()
    par = (tmp_path / "par" / "runs.csv").read_text().splitlines()
    assert [row.split(",")[:3] for row in par] == [row.split(",")[:3] for row in lines[:3]]
    assert (tmp_path / "par" / "w64_t768.log").stat().st_size > 0
    assert (out / "fit.png").stat().st_size > 0 and json.loads((out / "fit.json").read_text())["runs"] == 6
    dumps = [out / f"w{dim}_t{tokens}" for dim in (64, 128) for tokens in (768, 1536, 2560)]
    assert main(["fit", "--runs", *map(str, dumps)]) == 0
    assert json.loads(capsys.readouterr().out)["runs"] == 6
    for dump, row in zip(dumps, lines[1:], strict=True):
        args = resolve_model_args(parse_args(["--config", str(dump / "config.toml")]), 257)  # byte: 257 -> 320
        counts = count_params(args)
        steps = int(dump.name.split("_t")[1]) // 256
        val = [r for r in _metrics(dump) if "val_loss" in r][-1]
        run = read_dump(dump)
        assert args.dim == int(dump.name[1:].split("_")[0]) and args.vocab_size == 320
        assert run.params == counts["active"] - 2 * counts["embedding"]
        assert (run.tokens, run.loss, val["step"]) == (steps * 256, val["val_loss"], steps)
        assert row == f"{run.params},{run.tokens},{run.loss!r},{dump}"
    # tokens not logged (an older trainer): step x the global batch of run.json x seq_len
    older = tmp_path / "older"
    shutil.copytree(dumps[-1], older)
    (older / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "tokens"}) + "\n"
                                                 for r in _metrics(dumps[-1])))
    assert read_dump(older).tokens == 2560
    # no validation loss: one line naming the folder
    (older / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _metrics(dumps[-1])
                                                 if "val_loss" not in r))
    assert main(["fit", "--runs", *map(str, dumps), str(older)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {older}: no val_loss in metrics.jsonl (the trainer logs it after the last step unless "
        "eval.steps = 0; did the run finish?)")
