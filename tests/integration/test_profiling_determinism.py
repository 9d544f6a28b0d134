"""[profiling] traces exactly the steps asked for; training.deterministic runs are bitwise reproducible."""

from __future__ import annotations

import json
import re

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from trainer_utils import losses, run_trainer


def test_profiler_trace_holds_only_the_steps_asked_for(tmp_path):
    """Two ranks (FSDP): one trace per rank, with the Python stacks asked for."""
    dump = tmp_path / "prof"
    proc = run_trainer(dump, 2, "--training.steps", "5", "--profiling.enabled", "true",
                       "--profiling.start_step", "2", "--profiling.end_step", "3",
                       "--profiling.memory_snapshot", "true", "--profiling.with_stack", "true")
    warnings = [line for line in proc.stdout.splitlines() if "profiling.memory_snapshot skipped" in line]
    assert len(warnings) == 1  # CPU: one line (rank 0), the traces still written
    traces = sorted((dump / "profile").iterdir())
    assert [p.name for p in traces] == ["rank0_steps2-3.json", "rank1_steps2-3.json"]
    for trace in traces:
        events = json.loads(trace.read_text())["traceEvents"]
        steps = {int(m.group(1)) for e in events if (m := re.fullmatch(r"ProfilerStep#(\d+)", e.get("name", "")))}
        assert steps == {2, 3}
        assert any(e.get("name", "").startswith("aten::mm") for e in events)  # the steps' work is in it
        assert any(e.get("cat") == "python_function" and "trainer.py" in e["name"] for e in events)  # with_stack
    assert len(losses(dump)) == 5


def test_profiler_bad_step_range_is_one_line(tmp_path):
    proc = run_trainer(tmp_path / "bad", 0, "--profiling.enabled", "true", "--profiling.start_step", "4",
                       "--profiling.end_step", "2", check=False)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert err == ["error: profiling.end_step = 2 must be >= profiling.start_step = 4"]


def _final_weights(dump) -> dict[str, torch.Tensor]:
    out = dump / "final.pt"
    dcp_to_torch_save(dump / "checkpoint" / "step-6", out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


def test_deterministic_runs_are_bitwise_equal(tmp_path):
    """Two 2-process FSDP runs: the same losses and the same final weights, to the bit."""
    runs = []
    for name in ("a", "b"):
        dump = tmp_path / name
        run_trainer(dump, 2, "--training.deterministic", "true", "--training.steps", "6",
                    "--checkpoint.enabled", "true", "--checkpoint.interval", "6")
        runs.append((losses(dump), _final_weights(dump)))
    (losses_a, weights_a), (losses_b, weights_b) = runs
    assert len(losses_a) == 6 and losses_a == losses_b  # float equality: bitwise
    assert losses_a[6] < losses_a[1]
    assert weights_a.keys() == weights_b.keys() and len(weights_a) > 5
    for k in weights_a:
        assert torch.equal(weights_a[k], weights_b[k]), k
