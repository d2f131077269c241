"""H200: does launching Triton kernels from the autograd device thread cost the eager step host time?"""

# ruff: noqa: B023  (each closure is timed inside the loop iteration that defines it)

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from flash_backend._fast_launch import fast_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import step_us  # noqa: E402  (bench/probes/_timing.py, beside this file)


@triton.jit
def scale_kernel(X, Y, n, a, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=m) * a, mask=m)


def tri(x, fast=True):
    y = torch.empty_like(x)
    k = fast_kernel(scale_kernel) if fast else scale_kernel
    k[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), 1.0, BLOCK=1024)
    return y


def make(fwd_triton, bwd_triton, fast=True, launches=1):
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return tri(x, fast) if fwd_triton else x * 1

        @staticmethod
        def backward(ctx, g):
            for _ in range(launches - 1):
                tri(g, fast) if bwd_triton else g * 1
            return tri(g, fast) if bwd_triton else g * 1

    return F


x = torch.randn(1 << 16, device="cuda", requires_grad=True)
dout = torch.randn_like(x)


def run(fn, n=300):
    host, _, fwd, grad = step_us(lambda: fn(x), (x,), dout, n)
    return host, fwd, grad


for name, F in [
    ("torch / torch", make(False, False)),
    ("triton / torch", make(True, False)),
    ("torch / triton", make(False, True)),
    ("triton / triton", make(True, True)),
    ("triton / triton (Triton's own launch path)", make(True, True, fast=False)),
    ("torch / 3x triton", make(False, True, launches=3)),
    ("torch / 3x torch", make(False, False, launches=3)),
]:
    on = run(F.apply)
    with torch.autograd.set_multithreading_enabled(False):
        off = run(F.apply)
    print(
        f"{name:44s} threads on {on[0]:6.1f} (fwd {on[1]:5.1f} grad {on[2]:6.1f}) | off {off[0]:6.1f} "
        f"(fwd {off[1]:5.1f} grad {off[2]:6.1f}) | penalty {on[0] - off[0]:6.1f}",
        flush=True,
    )
