"""H200: how the autograd device-thread penalty scales with the Python time of a Function's backward."""

# ruff: noqa: B023  (each closure is timed inside the loop iteration that defines it)

import time

import torch


def make(spin_us):
    class Busy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            t_end = time.perf_counter() + spin_us * 1e-6
            while time.perf_counter() < t_end:
                pass
            return g * 1

    return Busy


x = torch.randn(1024, device="cuda", requires_grad=True)
dout = torch.randn_like(x)


def run(fn, n=300):
    for _ in range(20):
        torch.autograd.grad(fn(x), (x,), dout)
    torch.cuda.synchronize()
    tf = tg = 0.0
    t0 = time.perf_counter()
    for _ in range(n):
        a = time.perf_counter()
        o = fn(x)
        b = time.perf_counter()
        torch.autograd.grad(o, (x,), dout)
        c = time.perf_counter()
        tf += b - a
        tg += c - b
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6, tf / n * 1e6, tg / n * 1e6


for spin in (0, 50, 100, 200, 400):
    B = make(spin)
    on = run(B.apply)
    with torch.autograd.set_multithreading_enabled(False):
        off = run(B.apply)
    print(
        f"spin {spin:4d} us: threads on total {on[0]:6.1f} (fwd {on[1]:6.1f} grad {on[2]:6.1f}) | "
        f"off total {off[0]:6.1f} "
        f"(fwd {off[1]:6.1f} grad {off[2]:6.1f}) | penalty {on[0] - off[0]:6.1f}",
        flush=True,
    )
