"""Probe (H200): the head_dim 256 Gluon backward (kernels/attention_bwd_hopper_256.py) with the GQA head and
query block of an iteration counted in the loop (session 34) against the module before (argv[1]: HEAD's
file written to /tmp) and cuDNN's backward.

Why: each iteration derived its head and query block from the iteration index (`it // n_q_blocks`,
`it % n_q_blocks`: a 32-bit division in both consumer warpgroups and the producer, and one more for the next
block's query statistics). Counted instead, the sm_90 loops are 607 -> 560 (warpgroup 0) and 720 -> 708
(warpgroup 1) instructions causal, 531 -> 514 and 677 -> 665 non-causal, with ~30 more bytes of spills
(session 33's check, repeated in session 34). Every gradient is checked against fp32 first (at most 2x bf16
PyTorch's error, plus 1e-2 of the largest); then GPU time of back-to-back eager launches in interleaved
rounds (medians), cuDNN's backward as fwd+bwd minus fwd.

    git show HEAD:flash_backend/kernels/attention_bwd_hopper_256.py > /tmp/bwd256_before.py
    PYTHONPATH=. python bench/probes/attention_bwd256_counted_probe.py /tmp/bwd256_before.py
"""
# ruff: noqa: B023  (each closure is timed inside the iteration that defines it)

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention_bwd_acc_init_probe import grads, inputs, load, reference, verdict  # noqa: E402
from attention_fwd_peel_probe import interleaved_us  # noqa: E402

from flash_backend.kernels import attention_bwd_hopper as bwd  # noqa: E402
from flash_backend.kernels import attention_bwd_hopper_256 as new_256  # noqa: E402

SHAPES = [  # (B, H, Hkv, S, D, causal)
    (2, 16, 16, 4096, 256, False), (2, 16, 16, 4096, 256, True), (4, 16, 4, 2048, 256, True),
    (1, 16, 16, 16384, 256, False), (1, 16, 16, 16384, 256, True), (8, 16, 16, 1024, 256, False),
]
# checked only: odd lengths, GQA (several heads a CTA visits in turn), a single query block
CHECK_ONLY = [(2, 4, 4, 333, 256, True), (1, 6, 3, 700, 256, False), (1, 6, 2, 517, 256, True),
              (2, 4, 1, 129, 256, False), (1, 8, 2, 64, 256, True), (3, 2, 2, 1000, 256, False)]


def main():
    torch.manual_seed(0)
    mods = {"old": load(sys.argv[1], "bwd256_before"), "new": new_256}
    all_ok = True
    print(f"{'shape':<26} {'impl':<6} {'us':>9} {'TF/s':>7} {'x cudnn':>7} {'new/old':>7}  check")
    for B, H, Hkv, S, D, causal in CHECK_ONLY + SHAPES:
        args = inputs(B, H, Hkv, S, D, causal)
        checks = {}
        if S <= 4096:
            ref, low = (reference(args, causal, dtype) for dtype in (torch.float32, torch.bfloat16))
            for name, module in mods.items():
                checks[name] = verdict(grads(bwd, module, args, causal), ref, low)
                all_ok &= not checks[name].endswith("WRONG")
        shape = f"{B},{H}/{Hkv},{S},{D}{' causal' if causal else ''}"
        if (B, H, Hkv, S, D, causal) in CHECK_ONLY:
            print(f"{shape:<26} " + "  ".join(f"{n}: {c}" for n, c in checks.items()), flush=True)
            continue
        dout, q, k, v, _, _ = args
        qg = q.detach().requires_grad_()
        kg, vg = (t.repeat_interleave(H // Hkv, 1).detach().requires_grad_() for t in (k, v))

        def cudnn(backward):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            if backward:
                torch.autograd.grad(o, (qg, kg, vg), dout)

        fns = {"cudnn fwd+bwd": lambda: cudnn(True), "cudnn fwd": lambda: cudnn(False)}
        for name, module in mods.items():
            fns[name] = lambda m=module: grads(bwd, m, args, causal)
        us = interleaved_us(fns, rounds=9 if S < 16384 else 5, reps=10 if S < 16384 else 3)
        t_cudnn = us["cudnn fwd+bwd"] - us["cudnn fwd"]
        flops = 10 * B * H * S * S * D / (2 if causal else 1)
        print(f"{shape:<26} {'cudnn':<6} {t_cudnn:9.1f} {flops / t_cudnn / 1e6:7.1f}")
        for name in mods:
            t = us[name]
            print(f"{shape:<26} {name:<6} {t:9.1f} {flops / t / 1e6:7.1f} {t_cudnn / t:7.3f} "
                  f"{us['old'] / t:7.3f}  {checks.get(name, '')}", flush=True)
    print("all checks passed" if all_ok else "SOME CHECK FAILED")


if __name__ == "__main__":
    main()
