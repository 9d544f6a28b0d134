"""Bisect the compiled float8 experts' non-finite gradient norms (issue 40, deliverable 3; benchmarks/RESULTS.md,
"Compiled float8 MoDE experts"): the job of ``test_gpu_trainer_mode_debug_float8_experts`` (mode_debug, one GPU,
compiled, float8 linears + float8 experts, 30 steps) under each variant of the compiler, one process per variant,
printing how many steps had their update skipped (a non-finite gradient norm).

Variants (``python benchmarks/probe_float8_experts_compile.py [VARIANT ...]``, default all; ``PROBE_LOGS=DIR``
keeps each variant's whole output as DIR/VARIANT.log):
  inductor            the float8 experts inside the blocks' graphs (the trainer before the fix)
  experts_eager       the trainer as it is: float8 experts eager between the compiled graphs
  debug               inductor with Triton's device asserts on (TRITON_DEBUG=1) and CUDA_LAUNCH_BLOCKING=1
  aot_eager           AOTAutograd's graphs run eagerly (no inductor code generation)
  aot_eager_blocking  aot_eager with CUDA_LAUNCH_BLOCKING=1: a device-side assert names its own op
  no_reuse            inductor without buffer reuse
  launch_blocking     CUDA_LAUNCH_BLOCKING=1: rules a race between streams in or out
  eager               no compile

Found with it (2026-11-27, torch 2.11, torchao 0.17): experts_eager 0 skipped steps in two runs (H100); the
experts inside the graphs skipped steps in all eight runs: on an H200 7, 13 without buffer reuse, 10 with
CUDA_LAUNCH_BLOCKING=1; on an H100 6, 6, 8, and 10 and 11 with Triton's device asserts on (none fired); eager 0.
aot_eager stopped at an
out-of-range index in FlexAttention's causal mask function (``start[b, k]`` of a one-row mask for b >= 1),
a real bug, fixed in ops/visibility.py, but not this one: with it fixed, inductor still skipped 6-8 steps.
So the trainer runs float8 experts eagerly between the compiled graphs (parallel/parallelize.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("inductor", "experts_eager", "debug", "aot_eager", "aot_eager_blocking", "no_reuse",
            "launch_blocking", "eager")
BLOCKING = {"debug", "aot_eager_blocking", "launch_blocking"}
JOB = ["--config", "train_configs/mode_debug.toml", "--parallelism.ep", "1", "--parallelism.dp_shard", "1",
       "--data.tokenizer", "byte", "--checkpoint.enabled", "false", "--eval.steps", "0",
       "--metrics.tensorboard", "false", "--training.steps", "30", "--metrics.log_freq", "5",
       "--float8.enabled", "true", "--float8.experts", "true"]


def _child(variant: str, argv: list[str]) -> int:
    import torch

    if variant not in ("experts_eager", "eager"):  # the experts inside the graphs, as before the fix
        import torchtitan_ext.parallel.parallelize as parallelize

        apply_compile = parallelize.apply_compile

        def in_graph(model, experts_in_graph, tensor_parallel, compile_head=False):
            return apply_compile(model, True, tensor_parallel, compile_head)
        parallelize.apply_compile = in_graph
    compile_ = torch.compile
    if variant.startswith("aot_eager"):
        def patched(model=None, **kwargs):
            kwargs["backend"] = "aot_eager"
            return compile_(model, **kwargs) if model is not None else compile_(**kwargs)
        torch.compile = patched
    if variant == "no_reuse":
        torch._inductor.config.allow_buffer_reuse = False
    from torchtitan_ext.tools.train import main
    return main(argv)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(_child(sys.argv[2], sys.argv[3:]))
    for variant in sys.argv[1:] or VARIANTS:
        dump = Path(tempfile.mkdtemp(prefix=f"f8probe_{variant}_"))
        # The repository first, then whatever made torchao importable (a --target install on the lent machines).
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
        if variant in BLOCKING:
            env["CUDA_LAUNCH_BLOCKING"] = "1"
        if variant == "debug":
            env["TRITON_DEBUG"] = "1"
        compiled = ["--training.compile", "false" if variant == "eager" else "true"]
        proc = subprocess.run([sys.executable, __file__, "--child", variant, *JOB, *compiled,
                               "--job.dump_folder", str(dump)], cwd=REPO, env=env, capture_output=True, text=True)
        out = proc.stdout + proc.stderr
        if os.environ.get("PROBE_LOGS"):
            Path(os.environ["PROBE_LOGS"]).mkdir(parents=True, exist_ok=True)
            (Path(os.environ["PROBE_LOGS"]) / f"{variant}.log").write_text(out)
        for line in sorted({m for m in re.findall(r".*(?:Assertion|device-side assert|out of bounds).*", out)})[:5]:
            print(f"    {line.strip()[:300]}")
        skipped = len(re.findall(r"update skipped", out))
        losses = re.findall(r"loss[ :=]+([0-9.]+)", out)
        print(f"{variant:16s} exit {proc.returncode}  skipped steps {skipped:2d}  last loss "
              f"{losses[-1] if losses else '-'}", flush=True)
        if proc.returncode not in (0, 3) and not skipped:
            print(out[-2000:])


if __name__ == "__main__":
    main()
