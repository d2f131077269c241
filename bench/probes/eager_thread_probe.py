"""H200: is the eager attention's fwd+bwd host time the autograd engine's thread handoff?"""

# ruff: noqa: B023  (each closure is timed inside the loop iteration that defines it)

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_backend.ops import attention as A

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import step_us  # noqa: E402  (bench/probes/_timing.py, beside this file)


class Ident(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g * 1


def run(name, fwd, inputs, dout, n=200):
    host, wall, f, g = step_us(fwd, inputs, dout, n)
    print(f"  {name:44s} host {host:7.1f} wall {wall:7.1f}  fwd {f:6.1f}  grad {g:6.1f}", flush=True)


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
