"""H200 host: where the eager attention's host time goes (launch path pieces vs our Python)."""

# ruff: noqa: B023  (each closure is timed inside the loop iteration that defines it)

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.runtime import driver

from flash_backend.kernels import attention_fwd
from flash_backend.ops.attention import flash_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _timing  # noqa: E402  (bench/probes/_timing.py, beside this file)


def host_us(fn, n=300):
    return _timing.host_us(fn, n, warmup=20)


rec = []


class _Rec:
    def __init__(self, k):
        self.k = k

    def __getitem__(self, grid):
        def call(*a, **kw):
            rec.append((self.k, grid, a, kw))
            return self.k[grid](*a, **kw)

        return call


for B, H, S, D in [(64, 12, 197, 64), (16, 16, 1024, 64)]:
    q, k, v = (
        torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    dout = torch.randn_like(q)
    rec.clear()
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, device="cuda")
    attention_fwd.attention_forward_launch(
        q, k, v, None, None, 0.0, D**-0.5, -1, -1, False, out, lse, launch=_Rec
    )
    kern, grid, a, kw = rec[0]
    compiled = kern[grid](*a, **kw)
    dev = torch.cuda.current_device()
    binder = kern.device_caches[dev][4]
    bound, spec, opts = binder(*a, **kw)
    vals = tuple(bound.values())
    stream = driver.active.get_current_stream(dev)
    g = (grid[0], grid[1], 1)
    run = compiled.run
    fn_h, pm = compiled.function, compiled.packed_metadata
    res = {}
    res["triton full launch"] = host_us(lambda: kern[grid](*a, **kw))
    res["binder only"] = host_us(lambda: binder(*a, **kw))
    res["compiled.run direct"] = host_us(
        lambda: run(g[0], g[1], g[2], stream, fn_h, pm, None, None, None, *vals)
    )
    res["get stream (triton driver)"] = host_us(lambda: driver.active.get_current_stream(dev))
    res["torch current_stream"] = host_us(lambda: torch.cuda.current_stream().cuda_stream)
    res["new_empty(1)"] = host_us(lambda: q.new_empty(1))
    res["empty_like(q)"] = host_us(lambda: torch.empty_like(q))

    def ours_f():
        return flash_attention(q, k, v)

    def ours_fb():
        o = flash_attention(q, k, v)
        torch.autograd.grad(o, (q, k, v), dout)

    def cud_f():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    def cud_fb():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v)
        torch.autograd.grad(o, (q, k, v), dout)

    class Ident(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    def ident_fb():
        o = Ident.apply(q)
        torch.autograd.grad(o, (q,), dout)

    from flash_backend._fast_launch import fast_kernel

    fk = fast_kernel(kern)
    res["fast_kernel relaunch"] = host_us(lambda: fk[grid](*a, **kw))

    def nog(f):
        def g():
            with torch.no_grad():
                return f()

        return g

    for nm, f in [
        ("ours fwd no_grad", nog(ours_f)),
        ("cudnn fwd no_grad", nog(cud_f)),
        ("ours fwd", ours_f),
        ("ours fwd+bwd", ours_fb),
        ("cudnn fwd", cud_f),
        ("cudnn fwd+bwd", cud_fb),
        ("identity autograd.Function fwd+bwd", ident_fb),
    ]:
        res[nm] = host_us(f)
    print(f"== {B},{H},{S},{D} ({len(a)} positional args, {len(kw)} kw)")
    for nm, (h, w) in res.items():
        print(f"  {nm:40s} host {h:7.1f} us  wall {w:7.1f} us")
