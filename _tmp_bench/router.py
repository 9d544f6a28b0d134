import sys, torch, json, torch.nn.functional as F
sys.path.insert(0, 'benchmarks')
from bench_mode import bench
dev = torch.device('cuda')
for T in (16384, 32768):
    for E in (16, 128):
        x = torch.randn(T, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(E, 2048, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
        g = torch.randn(T, E, device=dev)
        variants = {
            "linear_bf16": lambda: F.linear(x, w).float(),
            "wx_t": lambda: (w @ x.t()).t().float(),
            "linear_fp32": lambda: F.linear(x.float(), w.float()),
            "pad128": lambda: F.linear(x, F.pad(w, (0, 0, 0, max(0, 128 - E)))).float()[:, :E],
            "mm_out_fp32": lambda: torch.mm(x, w.t(), out_dtype=torch.float32),
        }
        ref = F.linear(x.double(), w.double())
        for name, fn in variants.items():
            try:
                out = fn()
                err = ((out.double() - ref).norm() / ref.norm()).item()
                def run():
                    x.grad = None; w.grad = None
                    fn().backward(g)
                ms = bench(run, dev, 100, 500)
                with torch.no_grad():
                    fms = bench(fn, dev, 100, 500)
                print(json.dumps({"T": T, "E": E, "v": name, "fwd_bwd_ms": round(ms, 4), "fwd_ms": round(fms, 4), "rel_err": err}), flush=True)
            except Exception as e:
                print(T, E, name, "ERR", str(e)[:200])
