"""Hugging Face interchange at scale: sharded safetensors export (CLI, from a trained dump) whose logits equal
transformers', the streaming export's memory (one shard at a time, measured at the loader), ``load_hf`` of
sharded and bf16 folders, per-rank slice reading under FSDP2 and TP2 (bytes counted), continued pretraining
from a sharded folder on 2 FSDP processes = 1 process, and one-line refusals that leave nothing behind."""

from __future__ import annotations

import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from data_builders import random_decoder
from dist_utils import run_distributed

from torchtitan_ext.hf import load as hf_load
from torchtitan_ext.hf.architectures import ExportError
from torchtitan_ext.hf.export import export_checkpoint, export_model
from torchtitan_ext.hf.load import load_hf, load_hf_weights
from torchtitan_ext.hf.safetensors_io import SafetensorsReader, parse_size, plan_shards
from torchtitan_ext.models.decoder import Decoder

ARGS = dict(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=32)
MOE = dict(n_experts=4, top_k=2, moe_hidden=32)  # MoDE on every layer: MixtralForCausalLM


def test_size_parsing_and_shard_plan():
    assert [parse_size(v) for v in ("5GB", "500MB", "2MiB", "1kb", "123", 77)] == \
        [5 * 10**9, 5 * 10**8, 2 * 2**20, 1000, 123, 77]
    for bad in ("5XB", "0", "-1", "GB", ""):
        with pytest.raises(ExportError, match="--max-shard-size"):
            parse_size(bad)
    assert plan_shards([4, 4, 4, 9, 1, 1], 8) == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    assert plan_shards([3, 3], 100) == [range(0, 2)]


def _checkpoint(model: Decoder, folder: Path, ema: dict[str, torch.Tensor] | None = None) -> Path:
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    if ema is not None:
        state.update({f"ema.shadow.{k}": v for k, v in ema.items()})
        state["ema.started"] = torch.tensor(1)
    with warnings.catch_warnings():  # a checkpoint written by one process, as a one-GPU run writes it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(folder))
    return folder


def test_streaming_export_holds_one_shard(tmp_path, monkeypatch):
    """Every dcp.load of the export gets one shard's tensors (bf16, as written) and the previous shard's are
    freed by then: the bytes alive at a load never pass max_shard_size + the largest tensor, for a model 20x
    the limit. The EMA export writes the EMA's average."""
    model = random_decoder(base=ARGS, n_layers=4)
    ema = {n: p.detach() * 2 for n, p in model.named_parameters()}
    step = _checkpoint(model, tmp_path / "step-1", ema)
    alive: list[weakref.ref] = []
    loads: list[tuple[int, int]] = []  # (bytes of this load, bytes still alive from earlier loads)
    real_load = dcp.load

    def counting_load(state, **kw):
        tensors = [t for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
        earlier = sum(t.numel() * t.element_size() for r in alive if (t := r()) is not None)
        loads.append((sum(t.numel() * t.element_size() for t in tensors), earlier))
        alive.extend(weakref.ref(t) for t in tensors)
        return real_load(state, **kw)

    monkeypatch.setattr(dcp, "load", counting_load)
    limit = 8_000
    res = export_checkpoint(step, model.args, tmp_path / "hf", max_shard_size=limit)
    total = sum(v.numel() * 2 for v in model.state_dict().values())
    largest = max(v.numel() * 2 for v in model.state_dict().values())
    assert res.total_bytes == total > 20 * limit and len(res.weight_files) == len(loads) >= 20
    assert sum(n for n, _ in loads) == total  # every tensor read once
    assert max(n + earlier for n, earlier in loads) <= limit + largest
    assert all(earlier == 0 for _, earlier in loads)
    back = load_hf(tmp_path / "hf")
    for k, v in back.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, model.state_dict()[k].to(torch.bfloat16)), k
    export_checkpoint(step, model.args, tmp_path / "ema", dtype=torch.float32, weights="ema")
    for k, v in load_hf(tmp_path / "ema").named_parameters():
        assert torch.equal(v, ema[k]), k
    _checkpoint(model, tmp_path / "no-ema")
    with pytest.raises(ExportError, match="holds no EMA"):
        export_checkpoint(tmp_path / "no-ema", model.args, tmp_path / "x", weights="ema")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ema", "hf", "no-ema", "step-1"]


def test_stacked_experts_written_per_expert(tmp_path):
    """MoDE's stacked experts in a native MoE class (Mixtral here): one tensor per expert, a shard boundary
    falling inside a stack, transformers' logits equal ours, load_hf stacks them back."""
    transformers = pytest.importorskip("transformers")
    model = random_decoder(base=ARGS, **MOE)
    res = export_model(model, tmp_path, dtype=torch.float32, max_shard_size=10_000)
    assert res.architecture == "MixtralForCausalLM" and res.native
    ours = model.state_dict()["layers.1.feed_forward.experts.w1"]
    names = [f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight" for e in range(4)]
    with SafetensorsReader(tmp_path) as r:
        assert len({r.file_of[n] for n in names}) > 1  # the stack spans shards
        for e, name in enumerate(names):
            assert torch.equal(r.read(name), ours[e])
        assert not any("expert_bias" in n for n in r.shapes)
    x = torch.randint(0, 96, (2, 32))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=1e-5, atol=1e-5)
        back = load_hf(tmp_path)
        assert torch.equal(back(x), model(x))


def _load_sharded(rank: int, world: int, folder: str, layout: str) -> tuple[dict, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from torchtitan_ext.parallel.tp import apply_tp

    args = hf_load.read_config(Path(folder))
    shape, names = {"fsdp": ((world,), ("dp",)), "tp": ((world,), ("tp",)),
                    "fsdp_tp": ((world // 2, 2), ("dp", "tp"))}[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with torch.device("meta"):
        model = Decoder(args)
    if "tp" in layout:
        apply_tp(model, mesh["tp"], loss_parallel=False)
    if "fsdp" in layout:  # under TP: FSDP's share of each TP shard (a _StridedShard placement)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    read = load_hf_weights([model], folder, args)
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    return full, read


@pytest.mark.parametrize("layout, world, moe", [("fsdp", 2, False), ("tp", 2, False), ("fsdp", 2, True),
                                                ("fsdp_tp", 4, False)],
                         ids=["fsdp2", "tp2", "fsdp2_experts", "fsdp2_tp2"])
def test_each_rank_reads_its_slices(tmp_path, layout, world, moe):
    """gloo processes under FSDP2 (everything sharded on dim 0; stacked experts: each rank reads its experts),
    TP2 (colwise / rowwise, the norms replicated) or FSDP2 x TP2 (4 processes; uneven shards of the vocabulary
    and FFN): the full state each rank sees equals one process's load_hf, and each rank read only its share."""
    uneven = world == 4  # 250 / 2 / 2 and 200 / 2 / 2 rows: FSDP's shards of the TP shards differ in size
    model = random_decoder(base=ARGS, vocab_size=250 if uneven else 256, dim=128,
                           ffn_hidden=200 if uneven else 256, **(MOE if moe else {}))
    export_model(model, tmp_path / "hf", dtype=torch.float32, max_shard_size=100_000)
    total = sum(v.numel() * 4 for k, v in model.state_dict().items() if "expert_bias" not in k)
    replicated = sum(v.numel() * 4 for k, v in model.state_dict().items() if "norm" in k)
    one = load_hf(tmp_path / "hf").state_dict()
    assert total == SafetensorsReader(tmp_path / "hf").total_bytes()
    results = run_distributed(_load_sharded, world, str(tmp_path / "hf"), layout)
    for full, _ in results:
        assert full.keys() == one.keys() and all(torch.equal(full[k], one[k]) for k in one)
    reads = [read for _, read in results]
    # Under TP the norms are replicated over the TP ranks: each TP rank reads them (its FSDP share of them).
    expected = total if layout == "fsdp" else total + replicated
    assert sum(reads) == expected and max(reads) < 0.6 * total / (world // 2), (reads, total)
