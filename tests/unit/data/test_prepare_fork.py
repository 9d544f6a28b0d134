"""``prepare --workers N`` forks its workers: a forked worker must not run the destructors of the parent's
garbage. An unreferenced torch process group (a test's or a trainer's, kept only by a reference cycle) hung a
worker whose collector freed it (its threads were not forked), and the whole preparation with it: seen as a hang
of ``test_filters_in_order_with_workers_and_report`` in a CI run, after other tests in the same pytest worker had
left a process group behind."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, json, os, sys
    import torch.distributed as dist
    from torchtitan_ext.tools import prepare

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    cycle = {"group": group}
    cycle["self"] = cycle  # only the collector frees it
    del group, cycle
    gc.disable()  # the garbage survives until the fork ...
    os.register_at_fork(after_in_child=gc.collect)  # ... and each worker's first act is a collection
    folder = sys.argv[1]
    print(prepare.main(["--input", f"{folder}/in.jsonl", "--output-dir", f"{folder}/out", "--workers", "2",
                        "--chunk-docs", "2", "--filters", "heuristics", "--shard-tokens", "3000"]))
""")


def test_workers_survive_the_parents_garbage(tmp_path):
    with open(tmp_path / "in.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"text": " ".join(f"w{(j * 7919 + i * 104729) % 100003}" for j in range(300))}) + "\n")
    try:
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                              timeout=240)
    except subprocess.TimeoutExpired:
        raise AssertionError("prepare --workers 2 hung in 240 s: a worker ran the destructor of a process group "
                             "it inherited as garbage") from None
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "0", done.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir())  # shards were written
