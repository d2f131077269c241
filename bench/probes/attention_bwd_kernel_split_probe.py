"""Probe (H200): where a fwd+bwd step's GPU time goes, kernel by kernel, ours against SDPA's cuDNN.

torch.profiler over a few steps of `flash_attention(q, k, v)` + autograd.grad and of cuDNN's SDPA, same
inputs; prints each CUDA kernel's mean time per step (us) and the step's kernel sum. What it decides:
whether the backward's work outside its main kernel (delta preprocess, the fp32 dQ buffer's zero fill, its
cast to bf16) is where cuDNN's lead is, and so whether fusing them is worth a kernel change.

    python bench/probes/attention_bwd_kernel_split_probe.py
"""
from __future__ import annotations

import collections
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flash_backend.ops.attention import flash_attention  # noqa: E402

SHAPES = [(8, 16, 2048, 64, False), (2, 16, 8192, 64, False), (8, 16, 2048, 128, False),
          (4, 16, 4096, 128, True), (2, 16, 8192, 128, False)]
STEPS = 5


def kernel_times(step):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    totals = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name] += ev.device_time / STEPS
    return totals


def ours_step(q, k, v, dout, causal):
    torch.autograd.grad(flash_attention(q, k, v, is_causal=causal), (q, k, v), dout)


def cudnn_step(q, k, v, dout, causal):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.autograd.grad(out, (q, k, v), dout)


def main():
    torch.manual_seed(0)
    for B, H, S, D, causal in SHAPES:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
        print(f"== {B},{H},{S},{D} causal={causal}", flush=True)
        for name, step in (("ours", ours_step), ("cudnn", cudnn_step)):
            totals = kernel_times(functools.partial(step, q, k, v, dout, causal))
            print(f"  {name}: kernel sum {sum(totals.values()):9.1f} us a step")
            for kname, t in sorted(totals.items(), key=lambda kv: -kv[1]):
                print(f"    {t:9.1f}  {kname[:110]}")
            sys.stdout.flush()

if __name__ == "__main__":
    main()
