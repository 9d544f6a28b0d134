"""Summarise a py-spy raw profile (``py-spy record -f raw --threads``) of a training run's steady state.

    python benchmarks/host_profile.py PROFILE.txt

Drops the samples taken while compiling (dynamo, AOTAutograd, inductor), keeps those of the step
(``queue_step`` on the main thread, compiled backward graphs on autograd's thread), and prints the share of
each thread and the functions with the most samples, inclusive and self: where the host's time per step goes.
"""

from __future__ import annotations

import re
import sys
from collections import Counter

COMPILING = re.compile(r"convert_frame|compile_fx|_inductor/(codecache|async_compile|compile_worker|graph\.py)"
                       r"|_functorch/_aot_autograd/(jit_compile|graph_compile)|_dynamo/(symbolic_convert|output_graph)"
                       r"|autotune_to_one_config")
LINE = re.compile(r":\d+\)$")
IN_STEP = re.compile(r"queue_step|CompiledFunction.backward|run_backward|_engine_run_backward")


def main(path: str) -> None:
    threads, inclusive, self_ = Counter(), Counter(), Counter()
    total = 0
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit() or COMPILING.search(stack) or not IN_STEP.search(stack):
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        threads[frames[0]] += n
        for function in {LINE.sub(")", frame) for frame in frames[1:]}:  # per function, any line
            inclusive[function] += n
        self_[frames[-1]] += n
    print(f"samples in steps (compilation excluded): {total}")
    for thread, n in threads.most_common():
        print(f"  {100 * n / total:5.1f}%  {thread}")
    for title, counter, k in (("inclusive", inclusive, 30), ("self", self_, 20)):
        print(f"top functions, {title}:")
        for frame, n in counter.most_common(k):
            print(f"  {100 * n / total:5.1f}%  {frame}")


if __name__ == "__main__":
    main(sys.argv[1])
