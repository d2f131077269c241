"""H200: is the eager attention's fwd+bwd host time the autograd engine's thread handoff?"""

# ruff: noqa: B023  (each closure is timed inside the loop iteration that defines it)

import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_backend.ops import attention as A


class Ident(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g * 1


def run(name, fwd, inputs, dout, n=200):
    for _ in range(20):
        o = fwd()
        torch.autograd.grad(o, inputs, dout)
    torch.cuda.synchronize()
    tf = tg = 0.0
    t0 = time.perf_counter()
    for _ in range(n):
        a = time.perf_counter()
        o = fwd()
        b = time.perf_counter()
        torch.autograd.grad(o, inputs, dout)
        c = time.perf_counter()
        tf += b - a
        tg += c - b
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(
        f"  {name:44s} host {(t1 - t0) / n * 1e6:7.1f} wall {(t2 - t0) / n * 1e6:7.1f}  "
        f"fwd {tf / n * 1e6:6.1f}  grad {tg / n * 1e6:6.1f}",
        flush=True,
    )


B, H, S, D = 64, 12, 197, 64
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn_like(q)


def ours():
    return A.flash_attention(q, k, v)


def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v)


def ident():
    return Ident.apply(q)


for label, setup in [("default", lambda: None), ("switchinterval 1e-6", lambda: sys.setswitchinterval(1e-6))]:
    setup()
    print(label)
    for name, f, ins in [
        ("ours", ours, (q, k, v)),
        ("cudnn", cudnn, (q, k, v)),
        ("identity Function", ident, (q,)),
    ]:
        run(name, f, ins, dout)
    with torch.autograd.set_multithreading_enabled(False):
        for name, f, ins in [
            ("ours (autograd multithreading off)", ours, (q, k, v)),
            ("cudnn (autograd multithreading off)", cudnn, (q, k, v)),
            ("identity (multithreading off)", ident, (q,)),
        ]:
            run(name, f, ins, dout)
