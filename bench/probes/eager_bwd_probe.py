"""H200: host vs GPU time of the eager attention backward, and where its host time goes."""

# ruff: noqa: B023  (each closure is timed inside the loop iteration that defines it)

import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

from flash_backend.ops import attention as A
from flash_backend.ops._eager import plain_launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _timing  # noqa: E402  (bench/probes/_timing.py, beside this file)


def host_us(fn, n=200):
    return _timing.host_us(fn, n, warmup=10)


def graph_us(fn, n=50):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n * 1e3


for B, H, S, D in [(64, 12, 197, 64), (16, 16, 1024, 64)]:
    q, k, v = (
        torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    dout = torch.randn_like(q)
    scale = D**-0.5
    with torch.no_grad():
        out, lse = A._attention_forward_impl(
            q, k, v, None, None, 0.0, scale, -1, -1, False, launch=plain_launch
        )

    def bwd():
        return A._attention_backward_impl(
            dout, q, k, v, out, lse, None, None, 0.0, scale, -1, -1, False, False, False, launch=plain_launch
        )

    def fwd():
        return A._attention_forward_impl(q, k, v, None, None, 0.0, scale, -1, -1, False, launch=plain_launch)

    print(f"== {B},{H},{S},{D}")
    for nm, f in [("fwd impl", fwd), ("bwd impl", bwd)]:
        h, w = host_us(f)
        try:
            g = graph_us(f)
        except Exception as e:  # noqa
            g = float("nan")
            print("  graph capture failed:", type(e).__name__, str(e)[:200])
        print(f"  {nm:10s} host {h:7.1f} us  wall {w:7.1f} us  GPU (graph) {g:7.1f} us")

    def fb():
        o = A.flash_attention(q, k, v)
        torch.autograd.grad(o, (q, k, v), dout)

    h, w = host_us(fb)
    print(f"  flash_attention fwd+bwd host {h:7.1f} wall {w:7.1f}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        bwd()
    pr.disable()
    sio = io.StringIO()
    pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(18)
    print(sio.getvalue()[-4000:])
