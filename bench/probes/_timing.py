"""Host-time measurements shared by the eager probes (bench/probes/eager_*.py)."""

import time

import torch


def host_us(fn, n=300, warmup=20):
    """(host, wall) microseconds per call of fn: host is the time to issue the calls, wall adds the wait
    for the GPU to finish them."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def step_us(fwd, inputs, dout, n=300):
    """One eager training step, fwd() then torch.autograd.grad of its output w.r.t. inputs: (host, wall,
    forward, grad) microseconds per step, the last two host time of each half."""
    for _ in range(20):
        torch.autograd.grad(fwd(), inputs, dout)
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
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6, tf / n * 1e6, tg / n * 1e6
