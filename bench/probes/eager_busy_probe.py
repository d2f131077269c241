"""H200: how the autograd device-thread penalty scales with the Python time of a Function's backward."""

# ruff: noqa: B023  (each closure is timed inside the loop iteration that defines it)

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import step_us  # noqa: E402  (bench/probes/_timing.py, beside this file)


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
    host, _, fwd, grad = step_us(lambda: fn(x), (x,), dout, n)
    return host, fwd, grad


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
