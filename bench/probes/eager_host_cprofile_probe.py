"""Probe (H200): cProfile of our eager attention's forward and backward on the calling thread (autograd
multithreading off), at ViT's 64,12,197,64 (Triton kernels) and 16,16,1024,64 (Triton forward, Gluon
backward): which Python calls the host time of bench/logs/eager_step_anatomy_s34_h200.log goes to.

    PYTHONPATH=. python bench/probes/eager_host_cprofile_probe.py
"""

from __future__ import annotations

import cProfile
import io
import pstats

import torch

from flash_backend.ops.attention import flash_attention

SHAPES = [(64, 12, 197, 64), (16, 16, 1024, 64)]


def main():
    for B, H, S, D in SHAPES:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        with torch.autograd.set_multithreading_enabled(False):
            for _ in range(20):
                torch.autograd.grad(flash_attention(q, k, v), (q, k, v), dout)
            torch.cuda.synchronize()
            fwd_prof, bwd_prof = cProfile.Profile(), cProfile.Profile()
            for i in range(200):
                fwd_prof.enable()
                o = flash_attention(q, k, v)
                fwd_prof.disable()
                bwd_prof.enable()
                torch.autograd.grad(o, (q, k, v), dout)
                bwd_prof.disable()
                if i % 20 == 0:
                    torch.cuda.synchronize()
        for label, prof in (("forward", fwd_prof), ("backward", bwd_prof)):
            for key in ("tottime", "cumulative"):
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats(key).print_stats(22)
                print(f"--- {B},{H},{S},{D} {label}: 200 calls by {key}")
                print("\n".join(line[:160] for line in text.getvalue().splitlines()[4:32]), flush=True)


if __name__ == "__main__":
    main()
