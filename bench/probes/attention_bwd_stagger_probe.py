"""Probe (H200): the Gluon backwards (kernels/attention_bwd_hopper.py and its head_dim 256 kernel) with each
non-causal CTA starting its query blocks at its own key block (mod the number of query blocks: the
`_first_block` of session 34) against the modules before (argv[1], argv[2]: the files before the change
written to /tmp) and cuDNN's backward.

Why: without causal masking every CTA visited the query blocks in the same order from block 0, so the CTAs
of one head that run at once (all 132 of them at 1,16,16384,256) added their dQ tiles into the same rows
of the fp32 accumulator at about the same time (TMA reduce-adds, serialised where they meet in L2); the
non-causal rows are where the backward trails cuDNN's most (bench/results/attention.json at e5f5798). The
causal CTAs start at their diagonal, already apart. The first run had every non-causal CTA staggered
(bench/logs/attention_bwd_stagger_always_s34_h200.log): 1.04-1.08x at head_dim 256, with GQA and at 4096
keys, 0.98-0.99x at 1024-2048 keys; the launcher now staggers from STAGGER_MIN_SEQ_K keys (the head_dim
256 kernel always), which the second run measures (attention_bwd_stagger_s34_h200.log). Every gradient
is checked against fp32 first (at most 2x bf16 PyTorch's error, plus 1e-2 of the largest); then GPU time
of back-to-back eager launches in interleaved rounds (medians), cuDNN's backward as fwd+bwd minus fwd.

    git show HEAD:flash_backend/kernels/attention_bwd_hopper.py > /tmp/bwd_before.py
    git show HEAD:flash_backend/kernels/attention_bwd_hopper_256.py > /tmp/bwd256_before.py
    PYTHONPATH=. python bench/probes/attention_bwd_stagger_probe.py /tmp/bwd_before.py /tmp/bwd256_before.py
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

from attention_bwd_acc_init_probe import head_dim_256_module, load, verdict  # noqa: E402
from attention_bwd_peel_probe import run_shapes  # noqa: E402

from flash_backend.kernels import attention_bwd_hopper as new  # noqa: E402
from flash_backend.kernels import attention_bwd_hopper_256 as new_256  # noqa: E402

N = None
SHAPES = [  # (B, H, Hkv, S, D, causal, padding): padding N, or the fraction of keys the shortest row keeps
    (16, 16, 16, 1024, 64, False, N), (8, 16, 16, 2048, 64, False, N), (2, 16, 16, 8192, 64, False, N),
    (16, 16, 16, 1024, 128, False, N), (8, 16, 16, 2048, 128, False, N), (4, 16, 16, 4096, 128, False, N),
    (2, 16, 16, 8192, 128, False, N), (4, 32, 8, 4096, 128, False, N), (8, 16, 16, 2048, 64, False, 0.75),
    (2, 16, 16, 4096, 256, False, N), (1, 16, 16, 16384, 256, False, N),
    (8, 16, 16, 2048, 128, True, N), (1, 16, 16, 16384, 256, True, N),  # causal: the same order as before
]
# checked only: odd lengths, GQA, fewer query blocks than key blocks (Sq < Sk), padding, head_dim 256
CHECK_ONLY = [(2, 4, 4, 333, 64, False, N), (1, 4, 2, 1100, 64, False, N), (2, 6, 2, 517, 128, False, N),
              (2, 4, 1, 129, 64, False, N), (3, 4, 2, 1000, 64, False, 0.3), (2, 6, 3, 700, 128, False, 0.5),
              (2, 4, 4, 333, 256, False, N), (1, 6, 3, 700, 256, False, N), (1, 6, 2, 517, 256, True, N),
              (2, 6, 2, 517, 128, True, N)]


def grads(module, module_256, args, causal, mask=None):
    dout, q, k, v, out, lse = args
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    with head_dim_256_module(module_256):
        module.attention_backward_hopper_launch(dout, q, k, v, out, lse, q.shape[-1] ** -0.5, causal, dq, dk,
                                                dv, attn_mask=mask)
    return dq, dk, dv


def sq_lt_sk_check(mods):
    """Sq = 200 queries against Sk = 1000 keys (more key-block CTAs than query blocks): checked."""
    q = torch.randn(2, 4, 200, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(qf, kf, vf)
    dout = torch.randn_like(o)
    ref = torch.autograd.grad(o, (qf, kf, vf), dout)
    ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        ol = F.scaled_dot_product_attention(ql, kl, vl)
    low = [g.float() for g in torch.autograd.grad(ol, (ql, kl, vl), dout.to(ol.dtype))]
    out = ol.detach()
    lse = torch.logsumexp(qf.detach() @ kf.detach().transpose(-1, -2) * 128 ** -0.5, -1)
    ok = True
    for name, (m, m256) in mods.items():
        got = grads(m, m256, (dout.to(q.dtype), q, k, v, out, lse), False)
        result = verdict(got, [r[:1].float() for r in ref], [lo[:1] for lo in low])
        ok &= not result.endswith("WRONG")
        print(f"2,4/4,200x1000,128 {name}: {result}", flush=True)
    return ok


def main():
    torch.manual_seed(0)
    old = load(sys.argv[1], "bwd_before")
    old_256 = load(sys.argv[2], "bwd256_before", {"flash_backend.kernels.attention_bwd_hopper import":
                                                  "bwd_before import"})
    mods = {"old": (old, old_256), "new": (new, new_256)}
    sq_lt_sk_ok = sq_lt_sk_check(mods)
    ok = run_shapes(CHECK_ONLY, SHAPES, {name: (lambda args, causal, mask, m=m, m256=m256:
                                                grads(m, m256, args, causal, mask))
                                         for name, (m, m256) in mods.items()}, big_scores=2**38)
    if ok and not sq_lt_sk_ok:
        print("SOME CHECK FAILED (Sq < Sk)")


if __name__ == "__main__":
    main()
