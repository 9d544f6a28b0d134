"""``data/registry.py``: the source is named by ``data.dataset`` alone; the keys that disagree stop with one line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from data_builders import write_domains, write_trees
from trainer_utils import REPO

from torchtitan_ext.config.job_config import DataSection, JobConfig
from torchtitan_ext.data.packers.concat import TokenDataLoader
from torchtitan_ext.data.registry import SOURCES, build_loaders, source_name
from torchtitan_ext.data.sources.domains import MixingLoader
from torchtitan_ext.data.sources.trees import TreeDataLoader, prepare_trees
from torchtitan_ext.data.tokenizers.byte import ByteTokenizer
from torchtitan_ext.errors import ConfigError

TABLES = [{"name": "a", "train": "a.bin"}]


def test_dataset_choices_are_the_sources():
    choices = next(f for f in dataclasses.fields(DataSection) if f.name == "dataset").metadata["choices"]
    assert set(choices) == set(SOURCES)


@pytest.mark.parametrize("keys, message", [
    ({"attention": "tree"}, "data.attention = 'tree' needs data.dataset = 'trees' (got 'builtin')"),
    ({"dataset": "shards", "attention": "tree"}, "data.attention = 'tree' needs data.dataset = 'trees' (got 'shards')"),
    ({"dataset": "trees"}, "data.dataset = 'trees' needs data.attention = 'tree' (got 'causal')"),
    ({"domains": TABLES}, "data.domains is set: needs data.dataset = 'domains' (got 'builtin')"),
    ({"dataset": "shards", "domains": TABLES}, "data.domains is set: needs data.dataset = 'domains' (got 'shards')"),
    ({"dataset": "domains"}, "data.dataset = 'domains' needs [[data.domains]] tables"),
    ({"dataset": "parquet"}, "data.dataset = 'parquet': unknown source; valid: builtin, shards, trees, domains, chat"),
])
def test_disagreeing_keys_are_one_line(keys, message):
    with pytest.raises(ConfigError) as e:
        source_name(DataSection(**keys))
    assert str(e.value) == message


def test_dataset_alone_picks_the_source(tmp_path):
    """The same tree shards read as trees (tree attention), or as plain token shards: the dataset decides."""
    trees = tmp_path / "t.jsonl"
    write_trees(trees, 40, 0)
    prepare_trees([trees], tmp_path / "trees", ByteTokenizer())
    cfg = JobConfig()
    cfg.training.seq_len, cfg.training.local_batch_size = 32, 2
    cfg.data = DataSection(dataset="trees", attention="tree", train_path=str(tmp_path / "trees"))

    def loader(data: DataSection):
        return build_loaders(dataclasses.replace(cfg, data=data), ByteTokenizer(), dp_rank=0, dp_world_size=1,
                             vocab_limit=0).loader

    assert type(loader(cfg.data)) is TreeDataLoader
    assert type(loader(dataclasses.replace(cfg.data, dataset="shards", attention="causal"))) is TokenDataLoader
    assert type(loader(DataSection(dataset="domains", domains=write_domains(tmp_path)))) is MixingLoader


def test_trainer_refuses_domains_without_the_dataset_in_one_line(tmp_path):
    cfg = tmp_path / "domains.toml"
    cfg.write_text('[[data.domains]]\nname = "a"\ntrain = "/nonexistent/*.bin"\n')
    proc = subprocess.run([sys.executable, "-m", "torchtitan_ext.train", "--config", str(cfg), "--data.tokenizer",
                           "byte", "--job.dump_folder", str(tmp_path / "run")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: data.domains is set: needs data.dataset = 'domains' "
                                                "(got 'builtin')"]
