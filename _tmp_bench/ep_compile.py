"""EP dispatch path under torch.compile(fullgraph=True) + inductor, on one GPU with a 1-rank EP mesh."""
import os, sys, json, dataclasses, torch, torch.distributed as dist
sys.path.insert(0, '.'); sys.path.insert(0, 'benchmarks')
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
dist.init_process_group("nccl", rank=0, world_size=1)
torch.cuda.set_device(0)
from torch.distributed.device_mesh import init_device_mesh
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.parallel.ep import apply_ep
import inspect
from bench_mode import init_layer, rel_err
args = ModelArgs(vocab_size=512, dim=1024, n_layers=1, n_heads=8, n_kv_heads=4, n_experts=8, top_k=2, moe_hidden=512, max_seq_len=512)
res = {}
for mode in ("eager", "compiled"):
    torch.manual_seed(0)
    m = Decoder(args)
    init_layer(m, 0)
    m.init_buffers(torch.device("cpu"))
    m = m.cuda().bfloat16()
    mesh = init_device_mesh("cuda", (1,))
    kw = {"data_parallel_share": 1} if "data_parallel_share" in inspect.signature(apply_ep).parameters else {}
    apply_ep(m, mesh, **kw)
    blk = m.layers["0"]
    if mode == "compiled":
        m.layers["0"] = torch.compile(blk, fullgraph=True)
    m.train()
    tok = torch.randint(0, 512, (4, 512), generator=torch.Generator().manual_seed(1)).cuda()
    try:
        for _ in range(2):
            for p in m.parameters(): p.grad = None
            out = m(tok).float().square().mean(); out.backward()
        g = blk.feed_forward.experts.w1.grad
        g = g.to_local() if hasattr(g, "to_local") else g
        res[mode] = (out.item(), g.float().cpu())
        print(mode, "ok", out.item(), flush=True)
    except Exception as e:
        import traceback; traceback.print_exc()
        print(mode, "FAILED", type(e).__name__, str(e)[:500], flush=True)
if len(res) == 2:
    g0, g1 = res["eager"][1], res["compiled"][1]
    print("loss eager", res["eager"][0], "compiled", res["compiled"][0], "dw1 rel", rel_err(g1, g0))
dist.destroy_process_group()
