"""data.prepare's perplexity filter with a checkpoint of ours (trained here): the shuffled documents score highest
and are dropped."""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import numpy as np
from trainer_utils import run_trainer

import torchtitan_ext.tools.prepare as prep
from torchtitan_ext.data.shards import read_shard
from torchtitan_ext.data.tokenizers import ByteTokenizer
from torchtitan_ext.eval.load import perplexity_scores


def _docs_of(out: Path) -> list[str]:
    names = sorted(out.glob("val_*.bin")) + sorted(out.glob("train_*.bin"))
    stream = np.concatenate([np.asarray(read_shard(f)) for f in names]) if names else np.zeros(0, np.int64)
    tok = ByteTokenizer()
    return [tok.decode(d) for d in np.split(stream, np.flatnonzero(stream == tok.eot_id) + 1)[:-1]]


def test_ppl_filter_drops_the_shuffled_documents(tmp_path, capsys):
    dump = tmp_path / "ref"
    run_trainer(dump, 0, "--training.steps", "200", "--model.n_layers", "2", "--model.dim", "64",
                "--training.local_batch_size", "8", "--checkpoint.enabled", "true", "--checkpoint.interval", "200")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[20:38]
    real = [f.read_text()[1000:2500] for f in files]
    rng = random.Random(1)
    shuffled = []
    for text in real[:2]:
        chars = list(text)
        rng.shuffle(chars)  # byte tokens: the same unigram counts, no structure
        shuffled.append("".join(chars))
    docs = real[:9] + [shuffled[0]] + real[9:] + [shuffled[1]]
    scores = perplexity_scores(docs, str(dump))
    assert set(np.argsort(scores)[-2:]) == {9, 19}
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    out = tmp_path / "out"
    assert prep.main(["--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--filters", "ppl",
                      "--ppl-checkpoint", str(dump), "--ppl-percentile", "90"]) == 0
    report = json.loads(next(x for x in capsys.readouterr().err.splitlines() if x.startswith("{")))
    assert report["removed"] == {"ppl/above_percentile": 2}
    assert _docs_of(out) == real
