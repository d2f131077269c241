"""Probe (H200): the Gluon backward for Hopper (flash_backend/kernels/attention_bwd_hopper.py) in each
launch configuration, against cuDNN's backward and our Triton backward in one process, every gradient
checked against fp32 first. What it decides: which head dims route to the Gluon backward and with which
(BLOCK_M, STAGES) (the kernel module's CONFIGS). Logs: bench/logs/attention_gluon_bwd_probe*_h200.log;
findings in bench/NOTES_attention.md (session 23).

    python bench/attention_gluon_bwd_probe.py quick [256]  # small odd shapes only: a barrier bug hangs
    python bench/attention_gluon_bwd_probe.py [64 128]
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

from flash_backend.kernels.attention_bwd import attention_backward_launch  # noqa: E402
from flash_backend.kernels.attention_bwd_hopper import attention_backward_hopper_launch  # noqa: E402
from flash_backend.kernels.attention_fwd import attention_forward_launch  # noqa: E402

# (BLOCK_M, STAGES) tried per head_dim; at 256 (kernels/attention_bwd_hopper_256.py) the (Q, dO) ring depths
CONFIGS = {64: [(64, 2), (64, 3)], 128: [(64, 2), (64, 3)],
           256: [(2, 1), (1, 2), (1, 1)]}
SHAPES = [  # (B, H, Hkv, Sq, Sk, D, causal)
    (4, 16, 16, 4096, 4096, 128, False), (4, 16, 16, 4096, 4096, 128, True),
    (8, 16, 16, 2048, 2048, 128, False), (8, 16, 16, 2048, 2048, 128, True),
    (2, 16, 16, 8192, 8192, 128, True), (16, 16, 16, 1024, 1024, 128, True),
    (4, 32, 8, 4096, 4096, 128, True),
    (8, 16, 16, 2048, 2048, 64, False), (8, 16, 16, 2048, 2048, 64, True),
    (16, 16, 16, 1024, 1024, 64, True), (2, 16, 16, 8192, 8192, 64, False),
    (2, 16, 16, 4096, 4096, 256, False), (2, 16, 16, 4096, 4096, 256, True),
    (2, 16, 4, 4096, 4096, 256, True),
    (1, 16, 16, 16384, 16384, 256, False), (1, 16, 16, 16384, 16384, 256, True),
]
QUICK = [(2, 4, 4, 333, 333, 128, True), (2, 4, 2, 300, 517, 128, False), (1, 6, 3, 700, 259, 128, True),
         (2, 4, 4, 400, 400, 64, True), (1, 2, 1, 150, 600, 128, True), (2, 4, 1, 129, 1000, 64, False),
         (1, 2, 2, 1000, 100, 64, True),
         (2, 4, 4, 333, 333, 256, True), (2, 4, 2, 300, 517, 256, False), (1, 6, 3, 700, 259, 256, True),
         (1, 2, 1, 150, 600, 256, True), (1, 2, 2, 1000, 100, 256, True), (1, 2, 2, 64, 64, 256, False)]


def _bench(fn):
    return triton.testing.do_bench(fn, warmup=30, rep=200)


def _forward(q, k, v, causal):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    attention_forward_launch(q, k, v, None, None, 0.0, q.shape[-1] ** -0.5, -1, 0 if causal else -1, False,
                             out, lse, launch=lambda kernel: kernel)
    return out, lse


def _grads_gluon(dout, q, k, v, out, lse, causal, config):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    attention_backward_hopper_launch(dout, q, k, v, out, lse, q.shape[-1] ** -0.5, causal, dq, dk, dv,
                                     config=config)
    return dq, dk, dv


def _grads_triton(dout, q, k, v, out, lse, causal):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    attention_backward_launch(dout, q, k, v, out, lse, None, None, 0.0, q.shape[-1] ** -0.5, -1,
                              0 if causal else -1, False, dq, dk, dv, None, launch=lambda kernel: kernel)
    return dq, dk, dv


def _sdpa_grads(q, k, v, dout, causal, dtype):
    """Gradients of the math SDPA in `dtype` (fp32: the reference; bf16: PyTorch's own error)."""
    group = q.shape[1] // k.shape[1]
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    qx, kx, vx = leaves
    kx, vx = (t.repeat_interleave(group, 1) for t in (kx, vx))
    with sdpa_kernel([SDPBackend.MATH]):
        o = F.scaled_dot_product_attention(qx, kx, vx, is_causal=causal)
    o.backward(dout.to(dtype))
    return [t.grad.float() for t in leaves]


def run_shape(B, H, Hkv, Sq, Sk, D, causal, configs, check=True, timing=True):
    q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = _forward(q, k, v, causal)
    shape = f"{B},{H}/{Hkv},{Sq}x{Sk},{D}{' causal' if causal else ''}"
    flops = 10 * B * H * Sq * Sk * D / (2 if causal else 1)  # 2.5x the forward's 4 B H Sq Sk D
    verdicts = {}
    if check:  # fp32 reference on the first batch (Sq x Sk scores in memory)
        args = (q[:1], k[:1], v[:1], dout[:1], causal)
        ref = _sdpa_grads(*args, torch.float32)
        low = _sdpa_grads(*args, torch.bfloat16)
        bounds = [2 * (lo - r).abs().max().item() + 1e-2 * r.abs().max().item()
                  for lo, r in zip(low, ref, strict=True)]

        def verdict(grads):
            errs = [(g[:1].float() - r).abs().max().item() for g, r in zip(grads, ref, strict=True)]
            ok = all(e <= b for e, b in zip(errs, bounds, strict=True))
            ok = ok and all(torch.isfinite(g).all().item() for g in grads)
            pairs = " ".join(f"{e:.1e}<={b:.1e}" for e, b in zip(errs, bounds, strict=True))
            return f"dq/dk/dv err {pairs} {'OK' if ok else 'WRONG'}"

        verdicts["triton"] = verdict(_grads_triton(dout, q, k, v, out, lse, causal))
    t_cudnn = t_triton = float("nan")
    if timing:
        def cudnn_fwd_bwd():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            o.backward(dout)

        def cudnn_fwd():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)

        group = H // Hkv
        qg = q.detach().requires_grad_()
        kg, vg = (t.repeat_interleave(group, 1).detach().requires_grad_() for t in (k, v))
        t_cudnn = _bench(cudnn_fwd_bwd) - _bench(cudnn_fwd)
        t_triton = _bench(functools.partial(_grads_triton, dout, q, k, v, out, lse, causal))
        print(f"{shape:<28} {'cudnn bwd':<14} {t_cudnn:8.3f} {flops / t_cudnn / 1e9:7.1f}")
        print(f"{shape:<28} {'triton bwd':<14} {t_triton:8.3f} {flops / t_triton / 1e9:7.1f} "
              f"{t_cudnn / t_triton:7.3f}          {verdicts.get('triton', '')}", flush=True)
    elif check:
        print(f"{shape:<28} {'triton bwd':<14} {verdicts['triton']}", flush=True)
    for config in configs:
        name = f"gluon {config}"
        try:
            verdict_g = verdict(_grads_gluon(dout, q, k, v, out, lse, causal, config)) if check else ""
            if timing:
                t = _bench(functools.partial(_grads_gluon, dout, q, k, v, out, lse, causal, config))
                print(f"{shape:<28} {name:<14} {t:8.3f} {flops / t / 1e9:7.1f} {t_cudnn / t:7.3f} "
                      f"{t_triton / t:7.3f} {verdict_g}", flush=True)
            else:
                print(f"{shape:<28} {name:<14} {verdict_g}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{shape:<28} {name:<14} {type(e).__name__}: {str(e)[:300]}", flush=True)


def main():
    torch.manual_seed(0)
    print(f"{'shape':<28} {'impl':<14} {'ms':>8} {'TF/s':>7} {'x cudnn':>7} {'x triton':>7}")
    quick = len(sys.argv) > 1 and sys.argv[1] == "quick"
    head_dims = {int(a) for a in sys.argv[1 + quick:]} or set(CONFIGS)
    if quick:
        for B, H, Hkv, Sq, Sk, D, causal in QUICK:
            if D in head_dims:
                run_shape(B, H, Hkv, Sq, Sk, D, causal, CONFIGS[D], timing=False)
        return
    for B, H, Hkv, Sq, Sk, D, causal in SHAPES:
        if D in head_dims:
            run_shape(B, H, Hkv, Sq, Sk, D, causal, CONFIGS[D], check=Sq * Sk <= 8192 * 8192)


if __name__ == "__main__":
    main()
