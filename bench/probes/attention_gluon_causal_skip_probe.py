"""H200: the Gluon forward, causal, with each warpgroup computing only the key blocks its rows see ("new")
against the CTA-wide block count ("old": the module as of b342000, saved first with
`git show b342000:flash_backend/kernels/attention_fwd_hopper.py > /tmp/fwd_old.py`), cuDNN and the Triton
forward, output and logsumexp checked against fp32. Log: bench/logs/attention_gluon_causal_skip_s25_h200.log.

    python bench/probes/attention_gluon_causal_skip_probe.py /tmp/fwd_old.py
"""

# ruff: noqa: B023  (each closure is timed inside the loop iteration that defines it)

import functools
import importlib.util
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_backend.kernels import attention_fwd_hopper as new
from flash_backend.kernels.attention_fwd import attention_forward_launch
from flash_backend.ops.attention import attention_reference

_spec = importlib.util.spec_from_file_location("fwd_old", sys.argv[1])
fwd_old = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fwd_old)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=250)


def gluon(mod, q, k, v, causal, config):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    mod.attention_forward_hopper_launch(q, k, v, q.shape[-1] ** -0.5, causal, out, lse, config=config)
    return out, lse


def tri(q, k, v, causal):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    attention_forward_launch(
        q,
        k,
        v,
        None,
        None,
        0.0,
        q.shape[-1] ** -0.5,
        -1,
        0 if causal else -1,
        False,
        out,
        lse,
        launch=lambda kk: kk,
    )
    return out


CFG = {
    64: [(128, 2, True, 3), (128, 2, True, 2), (128, 2, False, 3)],
    128: [(128, 2, True, 2)],
    256: [(64, 2, False, 2)],
}
SHAPES = [
    (16, 16, 16, 1024, 64),
    (8, 16, 16, 2048, 64),
    (4, 16, 16, 4096, 64),
    (2, 16, 16, 8192, 64),
    (8, 16, 16, 2048, 128),
    (4, 16, 16, 4096, 128),
    (2, 16, 16, 8192, 128),
    (4, 32, 8, 4096, 128),
    (1, 16, 16, 16384, 256),
    (2, 4, 4, 333, 64),
    (2, 4, 2, 1000, 128),
]
torch.manual_seed(0)
print(f"{'shape':<22} {'impl':<22} {'ms':>8} {'TF/s':>7} {'x cudnn':>7}")
for B, H, Hkv, S, D in SHAPES:
    causal = True
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = 4 * B * H * S * S * D / 2
    nb = min(B, 2)
    ref_out, ref_lse = attention_reference(q[:nb], k[:nb], v[:nb], None, None, 0.0, None, -1, 0, False)
    low_out, _ = attention_reference(
        q[:nb], k[:nb], v[:nb], None, None, 0.0, None, -1, 0, False, upcast=False
    )
    err_low = (low_out.float() - ref_out.float()).abs().max().item()

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            kx, vx = (t.repeat_interleave(H // Hkv, 1) for t in (k, v)) if Hkv != H else (k, v)
            return F.scaled_dot_product_attention(q, kx, vx, is_causal=True)

    shape = f"{B},{H}/{Hkv},{S},{D}"
    tc = bench(cudnn)
    tt = bench(functools.partial(tri, q, k, v, True))
    print(f"{shape:<22} {'cudnn':<22} {tc:8.3f} {flops / tc / 1e9:7.1f}")
    print(f"{shape:<22} {'triton':<22} {tt:8.3f} {flops / tt / 1e9:7.1f} {tc / tt:7.3f}", flush=True)
    for cfg in CFG[D]:
        for name, mod in (("old", fwd_old), ("new", new)):
            out, lse = gluon(mod, q, k, v, True, cfg)
            err = (out[:nb].float() - ref_out.float()).abs().max().item()
            lse_err = (lse[:nb] - ref_lse.float()).abs().max().item()
            ok = err <= 2 * err_low + 1e-2 and lse_err < 1e-4 and torch.isfinite(out).all().item()
            t = bench(functools.partial(gluon, mod, q, k, v, True, cfg))
            label = f"{name} n{cfg[0]} c{cfg[3]}{' pp' if cfg[2] else ''}"
            verdict = f"{'OK' if ok else 'WRONG'} err {err:.1e} lse {lse_err:.1e}"
            rate = flops / t / 1e9
            print(f"{shape:<22} {label:<22} {t:8.3f} {rate:7.1f} {tc / t:7.3f} {verdict}", flush=True)
