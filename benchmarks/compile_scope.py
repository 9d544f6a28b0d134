"""Experiment: compile the whole model as one graph instead of one graph per block, optionally as a CUDA graph.

    python benchmarks/compile_scope.py MODE train|profile [trainer args]

MODE is ``default`` (one inductor graph for embedding, every block, norm and head) or ``reduce-overhead``
(the same, replayed as a CUDA graph: no per-kernel host launches). ``train`` runs ``python -m
torchtitan_ext.train``, ``profile`` runs ``benchmarks/profile_step.py NAME``. Only for layouts without FSDP, TP
or PP (one GPU): their hooks sit between the blocks. The trainer itself compiles per block
(``parallel/compile.py``).
"""

from __future__ import annotations

import runpy
import sys

import torch.nn as nn

import torchtitan_ext.parallel.parallelize as parallelize


def main() -> None:
    mode, entry, argv = sys.argv[1], sys.argv[2], sys.argv[3:]

    def compile_whole_model(model: nn.Module, experts_in_graph: bool, tensor_parallel: bool,
                            compile_head: bool = False) -> None:
        model.compile(fullgraph=True, mode=mode)

    parallelize.apply_compile = compile_whole_model
    if entry == "train":
        from torchtitan_ext.train.__main__ import main as train_main
        sys.exit(train_main(argv))
    sys.argv = ["benchmarks/profile_step.py", *argv]
    runpy.run_path("benchmarks/profile_step.py", run_name="__main__")


if __name__ == "__main__":
    main()
