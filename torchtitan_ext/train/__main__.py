"""Entry point: ``python -m torchtitan_ext.train --config FILE [--section.key value ...]``.

User mistakes (config, layout, data files) end with one ``error:`` line and exit code 2; a diverged
run (NaN loss, or gradients non-finite for training.max_skipped_steps steps in a row) ends with exit
code 3; a preempted run (SIGTERM / SIGUSR1) saves and ends with 0; anything else is a bug and keeps its traceback.

After a successful run (metrics closed, checkpoints written, process group destroyed) the process leaves
without interpreter teardown: in CI, pipeline-parallel gloo runs that had finished every step were aborted
there ("terminate called without an active exception", a C++ thread destroyed at exit).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from torchtitan_ext.config.loader import ConfigError, help_text, parse_args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    from torchtitan_ext.checkpoint.manager import CheckpointUnreadable
    from torchtitan_ext.data.shards import ShardError
    from torchtitan_ext.metrics.logger import rank_log
    from torchtitan_ext.parallel.dims import ParallelDimsError
    from torchtitan_ext.train.nonfinite import NonFiniteGradients
    from torchtitan_ext.train.trainer import Trainer, TrainingDiverged

    try:
        with rank_log(cfg.job.dump_folder, int(os.environ.get("RANK", 0))):
            Trainer(cfg).train()
        if dist.is_initialized():
            dist.barrier()  # gloo may abort at exit after FSDP2 work without it
    except (ConfigError, ParallelDimsError, ShardError, FileNotFoundError, CheckpointUnreadable) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except (TrainingDiverged, NonFiniteGradients) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    if code != 0:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
