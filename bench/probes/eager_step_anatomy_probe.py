"""Probe (H200): what an eager forward+backward of our attention costs, and where, at the bench's rows whose
fwd+bwd reads far below cuDNN's (bench/results/attention.json: ViT's 64,12,197,64, BERT's 32,12,512,64 and
8,16,2048,64 with a padding mask, 16,16,1024,64): the step as bench_attention times it (do_bench), the sum
of its GPU kernels and every CUDA runtime call of the step (torch.profiler; a synchronisation or a device-to-
host copy would show here), and the host time of the forward and of the backward on the calling thread
(autograd multithreading off), the same for cuDNN.

    PYTHONPATH=. python bench/probes/eager_step_anatomy_probe.py
"""
# ruff: noqa: B023  (each closure is used inside the iteration that defines it)

from __future__ import annotations

import collections
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import bench_ms  # noqa: E402
from bench_attention import _inputs  # noqa: E402

from flash_backend.ops.attention import flash_attention  # noqa: E402

ROWS = [(64, 12, 12, 197, 64, False, None), (32, 12, 12, 512, 64, False, "padding"),
        (8, 16, 16, 2048, 64, False, "padding"), (16, 16, 16, 1024, 64, False, None),
        (16, 16, 16, 1024, 64, True, None)]


def anatomy(step, n=20):
    """(kernel us a step, {runtime call: count a step}, kernels a step) from torch.profiler over n steps."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    gpu_us, runtime, kernels = 0.0, collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu_us += e.time_range.elapsed_us()
            kernels[e.name[:60]] += 1
        elif e.name.startswith("cuda") or e.name.startswith("cu"):
            runtime[e.name] += 1
    return gpu_us / n, {k: v / n for k, v in runtime.items()}, {k: v / n for k, v in kernels.items()}


def host_us(fwd, dout, leaves, n=200):
    """Median host microseconds of the forward and of the backward on the calling thread."""
    f, b = [], []
    with torch.autograd.set_multithreading_enabled(False):
        for _ in range(n):
            t0 = time.perf_counter()
            o = fwd()
            t1 = time.perf_counter()
            torch.autograd.grad(o, leaves, dout)
            t2 = time.perf_counter()
            f.append(t1 - t0)
            b.append(t2 - t1)
            if len(f) % 20 == 0:
                torch.cuda.synchronize()
    return statistics.median(f) * 1e6, statistics.median(b) * 1e6


def main():
    torch.manual_seed(0)
    for B, H, Hkv, S, D, causal, mask_kind in ROWS:
        q, k, v, mask = _inputs(B, H, Hkv, S, D, mask_kind)
        dout = torch.randn_like(q)
        impls = {"ours": lambda: flash_attention(q, k, v, attn_mask=mask, is_causal=causal)}

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

        impls["cudnn"] = cudnn
        print(f"== {B},{H},{S},{D}{' causal' if causal else ''}{' ' + mask_kind if mask_kind else ''}",
              flush=True)
        for name, fwd in impls.items():
            def step():
                torch.autograd.grad(fwd(), (q, k, v), dout)

            ms = bench_ms(step)
            gpu, runtime, kernels = anatomy(step)
            h_fwd, h_bwd = host_us(fwd, dout, (q, k, v))
            print(f"  {name:<6} do_bench {ms * 1e3:7.1f} us | kernels {gpu:7.1f} us | host fwd {h_fwd:6.1f} "
                  f"bwd {h_bwd:6.1f} us (multithreading off)", flush=True)
            print("    runtime calls a step: " + ", ".join(f"{k} {v:g}" for k, v in sorted(runtime.items())))
            print("    kernels a step: " + ", ".join(f"{k} {v:g}" for k, v in kernels.items()), flush=True)


if __name__ == "__main__":
    main()
