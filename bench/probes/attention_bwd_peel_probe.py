"""Probe (H200): the Gluon backward (kernels/attention_bwd_hopper.py, head_dim 64 / 128) with its causal
diagonal blocks in a loop of their own (session 33) against the module before (argv[1], HEAD's file written
to /tmp) and cuDNN's backward; and the loop over the query blocks of each GQA head without a division.

Why: the causal mask was chosen per query block inside the loop (`if m0 < first_key + KEYS`), and ptxas
predicated its selects onto every block: 33 FSEL an iteration at head_dim 128, 65 at 64, and their
predicates (sm_90 SASS; the consumer loops 693 / 1147 instructions causal against 578 / 944 non-causal). Now
the loop runs per head of the GQA group, its diagonal blocks first with the masking, the rest without, and
the next block's query statistics come without a division: 571 / 942 instructions causal, 554 / 908
non-causal (scratch check of session 33). Every gradient is checked against fp32 first (at most 2x bf16
PyTorch's error, plus 1e-2 of the largest); then GPU time of back-to-back eager launches in interleaved
rounds (medians; CUDA graphs are avoided: attention_fwd_peel_probe.py says why), cuDNN's backward as
fwd+bwd minus fwd.

    git show HEAD:flash_backend/kernels/attention_bwd_hopper.py > /tmp/bwd_before.py
    PYTHONPATH=. python bench/probes/attention_bwd_peel_probe.py /tmp/bwd_before.py
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

from attention_bwd_acc_init_probe import inputs, load, reference, verdict  # noqa: E402
from attention_fwd_peel_probe import interleaved_us, padding_mask  # noqa: E402

from flash_backend.kernels import attention_bwd_hopper as new  # noqa: E402
from flash_backend.kernels import attention_fwd_hopper as hopper_fwd  # noqa: E402

N = None
SHAPES = [  # (B, H, Hkv, S, D, causal, padding): padding N, or the fraction of keys the shortest row keeps
    (8, 16, 16, 2048, 64, True, N), (4, 16, 16, 4096, 64, True, N), (2, 16, 16, 8192, 64, True, N),
    (4, 32, 8, 4096, 64, True, N), (8, 16, 16, 2048, 64, False, N), (2, 16, 16, 8192, 64, False, N),
    (8, 16, 16, 2048, 128, True, N), (4, 16, 16, 4096, 128, True, N), (2, 16, 16, 8192, 128, True, N),
    (4, 32, 8, 4096, 128, True, N), (8, 16, 16, 2048, 128, False, N), (2, 16, 16, 8192, 128, False, N),
    (16, 16, 16, 1024, 128, False, N), (4, 32, 8, 4096, 128, False, N), (8, 16, 16, 2048, 64, False, 0.75),
    (8, 16, 16, 2048, 128, False, 0.75), (4, 16, 16, 4096, 64, False, 0.5),
]
# checked only: odd lengths, GQA, a query block per head that is all diagonal, padding
CHECK_ONLY = [(2, 4, 4, 333, 64, True, N), (1, 4, 2, 1100, 64, True, N), (2, 6, 2, 517, 128, True, N),
              (1, 8, 2, 333, 128, True, N), (2, 4, 1, 129, 64, False, N), (2, 4, 2, 517, 128, False, N),
              (3, 4, 2, 1000, 64, False, 0.3), (2, 6, 3, 700, 128, False, 0.5)]


def masked_inputs(B, H, Hkv, S, D, keep):
    """inputs()' tuple with a padding mask (additive bf16 (B, 1, 1, S), rows keep..1 of S long), the mask."""
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = padding_mask(B, S, keep, q.device)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    hopper_fwd.attention_forward_hopper_launch(q, k, v, D ** -0.5, False, out, lse, attn_mask=mask)
    return (torch.randn_like(q), q, k, v, out, lse), mask


def grads(module, args, causal, mask=None):
    dout, q, k, v, out, lse = args
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    module.attention_backward_hopper_launch(dout, q, k, v, out, lse, q.shape[-1] ** -0.5, causal, dq, dk, dv,
                                            attn_mask=mask)
    return dq, dk, dv


def report_against_cudnn(shape, args, mask, causal, impls, checks, rounds=9, reps=10):
    """Time each backward of impls (name -> zero-argument call; "old" the baseline) and cuDNN's (its
    fwd+bwd minus its fwd, k and v repeated for GQA) in interleaved rounds, and print a row each: us, TF/s,
    x cuDNN, x old and the impl's check."""
    dout, q, k, v, _, _ = args
    B, H, S, D = q.shape
    qg = q.detach().requires_grad_()
    kg, vg = (t.repeat_interleave(H // k.shape[1], 1).detach().requires_grad_() for t in (k, v))

    def cudnn(backward):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, is_causal=causal)
        if backward:
            torch.autograd.grad(o, (qg, kg, vg), dout)

    us = interleaved_us({"cudnn fwd+bwd": lambda: cudnn(True), "cudnn fwd": lambda: cudnn(False), **impls},
                        rounds=rounds, reps=reps)
    t_cudnn = us["cudnn fwd+bwd"] - us["cudnn fwd"]
    flops = 10 * B * H * S * S * D / (2 if causal else 1)
    print(f"{shape:<26} {'cudnn':<6} {t_cudnn:9.1f} {flops / t_cudnn / 1e6:7.1f}")
    for name in impls:
        t = us[name]
        print(f"{shape:<26} {name:<6} {t:9.1f} {flops / t / 1e6:7.1f} {t_cudnn / t:7.3f} "
              f"{us['old'] / t:7.3f}  {checks.get(name, '')}", flush=True)


def run_shapes(check_only, shapes, impls, big_scores=None):
    """Every shape (B, H, Hkv, S, D, causal, padding: None or the fraction of keys the shortest row keeps)
    of check_only + shapes: each impl's gradients (name -> grads(args, causal, mask); "old" the baseline)
    checked against fp32 up to 4096 rows, then the shapes timed (report_against_cudnn); from big_scores
    B * H * S * S * D on, fewer rounds. Returns whether every check passed."""
    all_ok = True
    print(f"{'shape':<26} {'impl':<6} {'us':>9} {'TF/s':>7} {'x cudnn':>7} {'new/old':>7}  check")
    for B, H, Hkv, S, D, causal, keep in check_only + shapes:
        if keep is None:
            args, mask = inputs(B, H, Hkv, S, D, causal), None
        else:
            args, mask = masked_inputs(B, H, Hkv, S, D, keep)
        checks = {}
        if S <= 4096:
            ref, low = (reference(args, causal, dtype, mask) for dtype in (torch.float32, torch.bfloat16))
            for name, grads_of in impls.items():
                checks[name] = verdict(grads_of(args, causal, mask), ref, low)
                all_ok &= not checks[name].endswith("WRONG")
        shape = f"{B},{H}/{Hkv},{S},{D}{' causal' if causal else ''}{'' if keep is None else f' pad {keep}'}"
        if (B, H, Hkv, S, D, causal, keep) in check_only:
            print(f"{shape:<26} " + "  ".join(f"{n}: {c}" for n, c in checks.items()), flush=True)
            continue
        big = big_scores is not None and B * H * S * S * D >= big_scores
        calls = {name: (lambda g=grads_of: g(args, causal, mask)) for name, grads_of in impls.items()}
        report_against_cudnn(shape, args, mask, causal, calls, checks, rounds=5 if big else 9,
                             reps=3 if big else 10)
    print("all checks passed" if all_ok else "SOME CHECK FAILED")
    return all_ok


def main():
    torch.manual_seed(0)
    mods = {"old": load(sys.argv[1], "bwd_before"), "new": new}
    run_shapes(CHECK_ONLY, SHAPES, {name: (lambda args, causal, mask, m=module: grads(m, args, causal, mask))
                                    for name, module in mods.items()})


if __name__ == "__main__":
    main()
