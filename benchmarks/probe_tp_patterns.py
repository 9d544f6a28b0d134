"""What Inductor's async-TP pass (micro-pipelined TP) finds in our compiled TP blocks, on CPU with gloo.

    python benchmarks/probe_tp_patterns.py [--ac none|selective] [trainer overrides ...]

Two gloo processes build the Decoder (the debug flavor unless overridden) with TP 2, optionally op-level
selective AC, compile it per block with ``_micro_pipeline_tp`` on, and run one forward and backward. The pass's
own pattern finders are wrapped to report, per compiled graph (forward, then backward), each all-gather with
the matmuls that consume it and each reduce-scatter with the matmul that produces it; the fusion itself needs
CUDA symmetric memory and is not attempted. A recomputed collective shows up as an extra all-gather or
reduce-scatter in the backward graph.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _report_patterns(report: list[str]) -> None:
    import torch._inductor.fx_passes.micro_pipeline_tp as mtp

    find_ag, find_rs = mtp.find_all_gather_patterns, mtp.find_reduce_scatter_patterns
    graphs = iter(("forward", "backward", "graph 3", "graph 4"))

    def all_gathers(graph):
        found = find_ag(graph)
        report.append(f"{next(graphs)}: {len(found)} all-gather(s)")
        for m in found:
            mms = [x for x in mtp._find_consumer_matmuls(m.res_node) if m.res_node not in x.arg_ancestor_nodes]
            report.append(f"  all-gather (dim {m.gather_dim}) -> {len(mms)} matmul(s)")
        return found

    def reduce_scatters(graph):
        found = find_rs(graph)
        report.append(f"  {len(found)} reduce-scatter(s)")
        for m in found:
            producer = mtp._find_producer_matmul(m.input_node)
            report.append(f"  reduce-scatter (dim {m.scatter_dim}) <- "
                          f"{'a matmul' if producer else f'{m.input_node.target} (not fusible)'}")
        return found

    mtp.find_all_gather_patterns, mtp.find_reduce_scatter_patterns = all_gathers, reduce_scatters
    mtp.fuse_all_gather_matmul = mtp.fuse_matmul_reduce_scatter = lambda *args, **kwargs: None


def _worker(rank: int, world: int, port: int, ac: str, overrides: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch._inductor.config as inductor_config
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_ext.config.loader import parse_args
    from torchtitan_ext.models.decoder import Decoder
    from torchtitan_ext.parallel.activation_checkpoint import apply_activation_checkpointing
    from torchtitan_ext.parallel.compile import apply_compile
    from torchtitan_ext.parallel.tp import apply_tp
    from torchtitan_ext.train.build import resolve_model_args

    report: list[str] = []
    _report_patterns(report)
    inductor_config._micro_pipeline_tp = True
    cfg = parse_args(["--model.n_layers", "1", *overrides])
    args = resolve_model_args(cfg, 512)
    with torch.device("meta"):
        model = Decoder(args)
    apply_tp(model, init_device_mesh("cpu", (world,)), loss_parallel=False)
    apply_activation_checkpointing(model, ac, 0)
    apply_compile(model, experts_in_graph=False, tensor_parallel=True, compile_head=False)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tokens = torch.randint(0, args.vocab_size, (2, cfg.training.seq_len))
    model(tokens).float().square().mean().backward()
    if rank == 0:
        print("\n".join(report))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ac", choices=("none", "selective"), default="selective")
    known, overrides = parser.parse_known_args()
    overrides = overrides or ["--model.dim", "256", "--model.n_heads", "8", "--model.n_kv_heads", "4",
                              "--training.seq_len", "64"]
    mp.spawn(_worker, args=(2, 29561, known.ac, overrides), nprocs=2)


if __name__ == "__main__":
    sys.exit(main())
