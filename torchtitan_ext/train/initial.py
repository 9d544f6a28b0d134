"""``checkpoint.initial_load_path``: the weights a job with no checkpoint of its own starts from (continued
pretraining, fine-tuning): a Hugging Face folder (``config.json`` + one safetensors file or an index and its
shards, each rank reading only the slices it holds: ``hf/load.py``), or one of our dump,
``checkpoint/`` or ``step-N`` folders, whose model is read under this job's layout whatever layout saved it
(DCP reshards). Optimizer, loader and step start fresh."""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan_ext.checkpoint.manager import ModelParts, complete_steps, unreadable_reason
from torchtitan_ext.checkpoint.safe_reader import UnsafeCheckpointFile, safe_load
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.hf.load import load_hf_weights
from torchtitan_ext.models.args import ModelArgs


def step_folder(path: Path) -> Path:
    """The checkpoint a dump, ``checkpoint/`` or ``step-N`` folder names (the latest complete one)."""
    if (path / ".metadata").is_file():
        return path
    for folder in (path / "checkpoint", path):
        steps = complete_steps(folder)
        if steps:
            return folder / f"step-{steps[-1]}"
    raise ConfigError(f"checkpoint.initial_load_path = {str(path)!r}: neither a Hugging Face folder (config.json) "
                      "nor a folder with a complete checkpoint (step-N/.metadata)")


def load_initial_weights(parts: list[nn.Module], path: str, args: ModelArgs) -> str:
    """Load the weights into the model ``parts``; returns what was loaded, for the log."""
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        load_hf_weights(parts, folder, args)
        return f"initial weights from the Hugging Face folder {folder}"
    checkpoint = step_folder(folder)
    try:
        safe_load({"model": ModelParts(parts)}, checkpoint)
    except UnsafeCheckpointFile:
        raise
    except (Exception, CheckpointException) as e:  # a missing or differently shaped tensor, a damaged shard
        raise ConfigError(f"checkpoint.initial_load_path: cannot load the model of {checkpoint} "
                          f"({unreadable_reason(e)})") from e
    return f"initial weights from {checkpoint}"
