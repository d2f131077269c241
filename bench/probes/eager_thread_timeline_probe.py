"""H200: a timeline of one eager attention step across the main thread and the autograd device thread.

Marks: forward start / end and grad() call / return on the main thread; backward entry / exit on the
thread that runs it. Prints the median of each interval, with multithreading on and off."""

# ruff: noqa: B023  (each closure is timed inside the loop iteration that defines it)

import cProfile
import io
import pstats
import statistics
import threading
import time

import torch

from flash_backend.ops import attention as A

marks = []
orig_bwd = A._DirectAttention.backward
profiler = None  # a cProfile.Profile while profile_body() runs: enabled on the thread running the backward


def timed_bwd(ctx, dout, dlse):
    marks.append(("bwd_in", time.perf_counter(), threading.get_ident()))
    if profiler is not None:
        profiler.enable()
    r = orig_bwd(ctx, dout, dlse)
    if profiler is not None:
        profiler.disable()
    marks.append(("bwd_out", time.perf_counter(), threading.get_ident()))
    return r


A._DirectAttention.backward = staticmethod(timed_bwd)

import os  # noqa: E402
import sys  # noqa: E402

# the shape from FLASH_PROBE_SHAPE="B,H,S,D" (ViT-base's by default)
B, H, S, D = (int(x) for x in os.environ.get("FLASH_PROBE_SHAPE", "64,12,197,64").split(","))
print(f"shape {B},{H},{S},{D}; switch interval {sys.getswitchinterval()} s", flush=True)
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn_like(q)


def run(label, n=300):
    for _ in range(20):
        torch.autograd.grad(A.flash_attention(q, k, v), (q, k, v), dout)
    torch.cuda.synchronize()
    marks.clear()
    steps = []
    for _ in range(n):
        t0 = time.perf_counter()
        o = A.flash_attention(q, k, v)
        t1 = time.perf_counter()
        n_before = len(marks)
        torch.autograd.grad(o, (q, k, v), dout)
        t2 = time.perf_counter()
        (_, b_in, tid), (_, b_out, _) = marks[n_before : n_before + 2]
        steps.append((t1 - t0, b_in - t1, b_out - b_in, t2 - b_out, tid != threading.get_ident()))
    torch.cuda.synchronize()
    med = [statistics.median(s[i] for s in steps) * 1e6 for i in range(4)]
    mean = [statistics.fmean(s[i] for s in steps) * 1e6 for i in range(4)]
    other = sum(s[4] for s in steps)
    print(
        f"{label}: backward on another thread in {other}/{n} steps\n"
        f"  median us: forward {med[0]:6.1f} | grad() -> backward entry {med[1]:6.1f} | backward body "
        f"{med[2]:6.1f} | backward exit -> grad() returns {med[3]:6.1f}\n"
        f"  mean us:   forward {mean[0]:6.1f} | grad() -> backward entry {mean[1]:6.1f} | backward body "
        f"{mean[2]:6.1f} | backward exit -> grad() returns {mean[3]:6.1f}",
        flush=True,
    )


run("multithreading on")
print("threads:", [t.name for t in threading.enumerate()], flush=True)
with torch.autograd.set_multithreading_enabled(False):
    run("multithreading off")
run("multithreading on, again")


def profile_body(label, n=200):
    """cProfile of the backward body alone, on whichever thread runs it: which calls get slower there."""
    global profiler
    profiler = cProfile.Profile()
    for _ in range(n):
        torch.autograd.grad(A.flash_attention(q, k, v), (q, k, v), dout)
    torch.cuda.synchronize()
    stats_text = io.StringIO()
    pstats.Stats(profiler, stream=stats_text).sort_stats("tottime").print_stats(14)
    profiler = None
    print(f"--- {label}: backward body, top calls by own time over {n} steps", flush=True)
    print("\n".join(stats_text.getvalue().splitlines()[4:26]), flush=True)


profile_body("multithreading on")
with torch.autograd.set_multithreading_enabled(False):
    profile_body("multithreading off")
