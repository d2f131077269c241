"""Probe (H200): the Gluon forward of this tree against another copy of kernels/attention_fwd_hopper.py
(argv[1], e.g. the module before a change, written to a file) and cuDNN, at each copy's routed
configurations: outputs and logsumexp checked against fp32 first, then times in interleaved rounds
(medians). Session 29 ran it for the FMA softmax (RAW_SCORES), then on at every configuration:
bench/logs/attention_gluon_fwd_fma_softmax_s29_h200.log.

    git show 0a15d7d:flash_backend/kernels/attention_fwd_hopper.py > /tmp/fwd_before.py
    python bench/probes/attention_fwd_fma_softmax_probe.py /tmp/fwd_before.py
"""
from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flash_backend.kernels import attention_fwd_hopper as new  # noqa: E402
from flash_backend.ops.attention import attention_reference  # noqa: E402

SHAPES = [  # (B, H, S, D, causal); the last two only checked (below 2**28 scores)
    (8, 16, 2048, 64, False), (2, 16, 8192, 64, False), (4, 16, 4096, 64, True), (2, 16, 8192, 64, True),
    (8, 16, 2048, 128, False), (8, 16, 2048, 128, True), (4, 16, 4096, 128, False), (2, 16, 8192, 128, False),
    (2, 16, 8192, 128, True), (1, 16, 16384, 256, False), (4, 16, 4096, 64, False), (2, 4, 333, 64, True),
    (2, 4, 1000, 128, False),
]


def run(mod, q, k, v, causal):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    mod.attention_forward_hopper_launch(q, k, v, q.shape[-1] ** -0.5, causal, out, lse)
    return out, lse


def cudnn(q, k, v, causal):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def check(new_out, old_out, new_lse, q, k, v, causal):
    right = 0 if causal else -1
    ref_out, ref_lse = attention_reference(q[:1], k[:1], v[:1], None, None, 0.0, None, -1, right, False)
    low_out, _ = attention_reference(q[:1], k[:1], v[:1], None, None, 0.0, None, -1, right, False,
                                     upcast=False)
    err_low = (low_out.float() - ref_out.float()).abs().max().item()
    err_new = (new_out[:1].float() - ref_out.float()).abs().max().item()
    err_old = (old_out[:1].float() - ref_out.float()).abs().max().item()
    lse_err = (new_lse[:1] - ref_lse.float()).abs().max().item()
    ok = err_new <= 2 * err_low + 1e-2 and lse_err < 1e-4 and torch.isfinite(new_out).all().item()
    return (f"err new {err_new:.2e} old {err_old:.2e} torch bf16 {err_low:.2e} lse {lse_err:.1e} "
            f"{'OK' if ok else 'WRONG'}")


def main():
    spec = importlib.util.spec_from_file_location("fwd_other", sys.argv[1])
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    torch.manual_seed(0)
    print(f"{'shape':<22} {'old ms':>8} {'new ms':>8} {'cudnn':>8} {'new/old':>8} {'x cudnn old':>11} "
          f"{'x cudnn new':>11}  check")
    for B, H, S, D, causal in SHAPES:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        new_out, new_lse = run(new, q, k, v, causal)
        old_out, _ = run(old, q, k, v, causal)
        verdict = check(new_out, old_out, new_lse, q, k, v, causal)
        shape = f"{B},{H},{S},{D}{' causal' if causal else ''}"
        if B * H * S * S < (1 << 28):
            print(f"{shape:<22} (check only) {verdict}", flush=True)
            continue
        fns = {"old": functools.partial(run, old, q, k, v, causal),
               "new": functools.partial(run, new, q, k, v, causal),
               "cudnn": functools.partial(cudnn, q, k, v, causal)}
        times = {name: [] for name in fns}
        for _ in range(3):  # interleaved rounds
            for name, fn in fns.items():
                times[name].append(triton.testing.do_bench(fn, warmup=50, rep=300))
        t = {name: sorted(ts)[1] for name, ts in times.items()}
        print(f"{shape:<22} {t['old']:8.3f} {t['new']:8.3f} {t['cudnn']:8.3f} {t['old'] / t['new']:8.3f} "
              f"{t['cudnn'] / t['old']:11.3f} {t['cudnn'] / t['new']:11.3f}  {verdict}", flush=True)


if __name__ == "__main__":
    main()
