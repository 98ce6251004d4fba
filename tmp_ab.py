# diagnostic (untracked): same-process A/B of fused T = 1 launches, interleaved rounds
import sys, torch, dsv4lab
from dsv4lab import bench
from dsv4lab.benchmarks.moe import FLASH, _random_experts, experts_for
from dsv4lab.ops import route
from dsv4lab.kernels import moe_mma2
dev = torch.device("cuda")
E, H, I, k = FLASH["E"], FLASH["H"], FLASH["I"], FLASH["topk"]
gen = torch.Generator(device=dev).manual_seed(0)
base = dict(FUSED=True, BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4, EVICT=True, PREFETCH=False)
variants = [("entry", {})] + [(a, eval(f"dict({a})")) for a in sys.argv[1:]]
for fmt in ("mxfp4", "nvfp4"):
    ex = _random_experts(E, H, I, fmt, dev, gen)
    kw = {n: v.to(dev).reshape(-1).expand(E).contiguous() for n, v in ex["kw"].items()}
    g2 = torch.Generator(device=dev).manual_seed(1)
    ids, w = route(torch.randn(1, E, device=dev, generator=g2), torch.randn(E, device=dev, generator=g2) * 0.1, topk=k)
    x = torch.randn(1, H, device=dev, generator=g2).to(torch.bfloat16)
    runs, outs, ts = {}, {}, {}
    for name, ch in variants:
        opts = dict(base, **ch)
        exx = experts_for(ex, dict(MMA2=opts), fmt, 1)
        runs[name] = (lambda exx=exx, opts=opts: moe_mma2.fused_moe(x, exx["w13"], exx["w13_scale"], exx["w2"], exx["w2_scale"], ids, w, fmt=fmt, swiglu_limit=10.0, **kw, **opts))
        outs[name] = runs[name]()
        ts[name] = []
    for rnd in range(3):
        for name, _ in variants:
            ts[name].append(bench.time_graph(runs[name], warmup_ms=3, rep_ms=15)["ms"] * 1e3)
    for name, _ in variants:
        print(f"{fmt} {name:<50} " + " ".join(f"{t:5.1f}" for t in ts[name]) + f"  same bits {bool(torch.equal(outs[name], outs['entry']))}", flush=True)
