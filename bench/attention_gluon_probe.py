"""Probe (H200): the Gluon forward for Hopper (flash_backend/kernels/attention_fwd_hopper.py) in each launch
configuration, against cuDNN and our Triton forward in one process, output and logsumexp checked against
fp32 first. What it decides: which (head_dim, causal) route to the Gluon kernel and with which
(BLOCK_N, STAGES, PINGPONG, CONSUMERS) (the kernel module's CONFIGS). Logs:
bench/logs/attention_gluon_probe*_h200.log; findings in bench/NOTES_attention.md (session 22).

    python bench/attention_gluon_probe.py [64 128 256]   # on a GPU; optionally only these head dims
    python bench/attention_gluon_probe.py quick    # two small cases first: a barrier bug hangs, not fails
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flash_backend.kernels.attention_fwd import attention_forward_launch  # noqa: E402
from flash_backend.kernels.attention_fwd_hopper import attention_forward_hopper_launch  # noqa: E402
from flash_backend.ops.attention import attention_reference  # noqa: E402

CONFIGS = {  # (BLOCK_N, STAGES, PINGPONG, CONSUMERS) tried per head_dim
    64: [(128, 2, True, 2), (128, 2, True, 3), (128, 3, True, 3), (64, 3, True, 3), (128, 2, False, 3)],
    128: [(128, 2, False, 2), (128, 2, True, 2)],
    256: [(64, 2, False, 2), (64, 2, True, 2)],
}
SHAPES = [  # (B, H, Hkv, S, D, causal)
    (4, 16, 16, 4096, 128, False), (4, 16, 16, 4096, 128, True), (8, 16, 16, 2048, 128, False),
    (8, 16, 16, 2048, 128, True), (2, 16, 16, 8192, 128, True), (16, 16, 16, 1024, 128, True),
    (32, 16, 16, 512, 128, False), (4, 32, 8, 4096, 128, True), (1, 16, 16, 16384, 256, False),
    (1, 16, 16, 16384, 256, True), (8, 16, 16, 2048, 64, False), (8, 16, 16, 2048, 64, True),
    (16, 16, 16, 1024, 64, True), (2, 16, 16, 8192, 64, False),
]


def _bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300)


def _gluon(q, k, v, causal, config):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    attention_forward_hopper_launch(q, k, v, q.shape[-1] ** -0.5, causal, out, lse, config=config)
    return out, lse


def _triton(q, k, v, causal):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    right = 0 if causal else -1
    attention_forward_launch(q, k, v, None, None, 0.0, q.shape[-1] ** -0.5, -1, right, False, out, lse,
                             launch=lambda kernel: kernel)
    return out


def run_shape(B, H, Hkv, S, D, causal, configs, check=True):
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    right = 0 if causal else -1
    if check:  # fp32 reference on the first two batches (S x S scores in memory)
        ref_out, ref_lse = attention_reference(q[:2], k[:2], v[:2], None, None, 0.0, None, -1, right, False)
        low_out, _ = attention_reference(q[:2], k[:2], v[:2], None, None, 0.0, None, -1, right, False,
                                         upcast=False)
        err_low = (low_out.float() - ref_out.float()).abs().max().item()

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            kx, vx = (t.repeat_interleave(H // Hkv, 1) for t in (k, v)) if Hkv != H else (k, v)
            return F.scaled_dot_product_attention(q, kx, vx, is_causal=causal)

    shape = f"{B},{H}/{Hkv},{S},{D}{' causal' if causal else ''}"
    t_cudnn, t_triton = _bench(cudnn), _bench(functools.partial(_triton, q, k, v, causal))
    print(f"{shape:<24} {'cudnn':<18} {t_cudnn:8.3f} {flops / t_cudnn / 1e9:7.1f}")
    print(f"{shape:<24} {'triton':<18} {t_triton:8.3f} {flops / t_triton / 1e9:7.1f} "
          f"{t_cudnn / t_triton:7.3f}")
    for config in configs:
        name = "gluon n{} s{}{} c{}".format(*config[:2], " pp" if config[2] else "", config[3])
        try:
            verdict = ""
            if check:
                out, lse = _gluon(q, k, v, causal, config)
                err = (out[:2].float() - ref_out.float()).abs().max().item()
                lse_err = (lse[:2] - ref_lse.float()).abs().max().item()
                ok = err <= 2 * err_low + 1e-2 and lse_err < 1e-4 and torch.isfinite(out).all().item()
                verdict = (f"err {err:.2e} (torch bf16 {err_low:.2e}) lse {lse_err:.1e} "
                           f"{'OK' if ok else 'WRONG'}")
            t = _bench(functools.partial(_gluon, q, k, v, causal, config))
            print(f"{shape:<24} {name:<18} {t:8.3f} {flops / t / 1e9:7.1f} {t_cudnn / t:7.3f} "
                  f"{t_triton / t:7.3f} {verdict}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{shape:<24} {name:<18} {type(e).__name__}: {str(e)[:300]}", flush=True)


def main():
    torch.manual_seed(0)
    print(f"{'shape':<24} {'impl':<18} {'ms':>8} {'TF/s':>7} {'x cudnn':>7} {'x triton':>7}")
    if len(sys.argv) > 1 and sys.argv[1] == "quick":
        run_shape(2, 4, 4, 333, 128, True, CONFIGS[128])
        run_shape(2, 4, 2, 300, 256, False, CONFIGS[256])
        run_shape(2, 4, 2, 400, 64, True, CONFIGS[64])
        return
    head_dims = {int(a) for a in sys.argv[1:]} or set(CONFIGS)  # e.g. `attention_gluon_probe.py 64 256`
    for B, H, Hkv, S, D, causal in SHAPES:
        if D not in head_dims:
            continue
        run_shape(B, H, Hkv, S, D, causal, CONFIGS[D], check=S * S * B <= 2 * 8192 * 8192)


if __name__ == "__main__":
    main()
