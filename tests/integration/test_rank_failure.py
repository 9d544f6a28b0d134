"""An unexpected exception on one rank of a multi-process job ends that process at once, with its traceback and
exit code 1, without destroying the process group: with NCCL, destroying a group while the other ranks wait in a
collective (or a pipeline receive) that this rank will never join waits for them, and a pipeline schedule's error
on one rank hung its job until the test's timeout (4 H200s). torchrun then stops the other workers."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from dist_utils import free_port

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torchtitan_ext.cli import run_tool

    destroy = dist.destroy_process_group
    def recorded_destroy(*args, **kwargs):
        print(f"rank {dist.get_rank()}: process group destroyed", flush=True)
        destroy(*args, **kwargs)
    dist.destroy_process_group = recorded_destroy

    def main(argv):
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            dist.irecv(torch.zeros(4), src=0)  # a receive in flight, as in a pipeline schedule
            raise RuntimeError("boom on rank 1")
        dist.barrier()  # rank 1 never joins it

    raise SystemExit(run_tool(main, []))
""")


def test_a_failing_rank_leaves_at_once_with_its_traceback(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "--tee", "3", "--log_dir", str(tmp_path / "logs"), str(script)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "RuntimeError: boom on rank 1" in out, out[-3000:]
    assert "rank 1: process group destroyed" not in out, out[-3000:]
    assert "exitcode  : 1" in out, out[-3000:]
