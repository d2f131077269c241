"""Probe (H200): the Gluon backwards of this tree (kernels/attention_bwd_hopper.py and its head_dim 256
kernel) against other copies of both modules (argv[1], argv[2]: e.g. the modules before a change, written
to files) and cuDNN's backward, at each copy's routed configuration: every gradient checked against fp32
first, then GPU times of the launches in interleaved rounds of CUDA-graph replays (medians). At head_dim 64
it also times this tree's kernel at BLOCK_M 64. Session 30 ran it for the products that start from the
query statistics (ACC_INIT): bench/logs/attention_gluon_bwd_acc_init_ab_s30_h200.log.

    git show 19b441c:flash_backend/kernels/attention_bwd_hopper.py > /tmp/bwd_before.py
    git show 19b441c:flash_backend/kernels/attention_bwd_hopper_256.py > /tmp/bwd256_before.py
    python bench/probes/attention_bwd_acc_init_probe.py /tmp/bwd_before.py /tmp/bwd256_before.py
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import capture_graph, interleaved_graph_us  # noqa: E402
from attention_gluon_bwd_probe import _forward as forward  # noqa: E402

import flash_backend.kernels as kernels_pkg  # noqa: E402
from flash_backend.kernels import attention_bwd_hopper as new  # noqa: E402
from flash_backend.kernels import attention_bwd_hopper_256 as new_256  # noqa: E402

SHAPES = [  # (B, H, Hkv, S, D, causal)
    (8, 16, 16, 2048, 64, False), (8, 16, 16, 2048, 64, True), (2, 16, 16, 8192, 64, False),
    (2, 16, 16, 8192, 64, True), (4, 16, 16, 4096, 64, True), (4, 32, 8, 4096, 64, True),
    (16, 16, 16, 1024, 64, False), (32, 12, 12, 512, 64, False), (64, 12, 12, 197, 64, False),
    (8, 16, 16, 2048, 128, False), (8, 16, 16, 2048, 128, True), (4, 16, 16, 4096, 128, True),
    (2, 16, 16, 8192, 128, False), (4, 32, 8, 4096, 128, True), (16, 16, 16, 1024, 128, False),
    (2, 16, 16, 4096, 256, False), (2, 16, 16, 4096, 256, True), (1, 16, 16, 16384, 256, False),
]
QUICK = [(2, 4, 4, 333, 64, True), (2, 4, 1, 129, 64, False), (1, 6, 3, 700, 128, True),
         (2, 4, 2, 517, 128, False), (2, 4, 4, 333, 256, True), (1, 6, 3, 700, 256, False)]


def load(path, name, replace=None):
    source = Path(path).read_text()
    for old, repl in (replace or {}).items():
        source = source.replace(old, repl)
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    exec(compile(source, path, "exec"), module.__dict__)  # noqa: S102
    return module


@contextlib.contextmanager
def head_dim_256_module(module):
    """The launcher imports `attention_bwd_hopper_256` from the package at call time: point it at module."""
    saved = kernels_pkg.attention_bwd_hopper_256
    kernels_pkg.attention_bwd_hopper_256 = module
    try:
        yield
    finally:
        kernels_pkg.attention_bwd_hopper_256 = saved


def grads(module, module_256, args, causal, config=None):
    dout, q, k, v, out, lse = args
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    with head_dim_256_module(module_256):
        module.attention_backward_hopper_launch(dout, q, k, v, out, lse, q.shape[-1] ** -0.5, causal, dq, dk,
                                                dv, config=config)
    return dq, dk, dv


def reference(args, causal, dtype, mask=None):
    """The gradients of batch 0 through SDPA's math backend in dtype (k and v repeated for GQA), with an
    additive or boolean attn_mask if given."""
    dout, q, k, v, _, _ = args
    group = q.shape[1] // k.shape[1]
    leaves = [t[:1].detach().to(dtype).requires_grad_() for t in (q, k, v)]
    qx, kx, vx = leaves
    kx, vx = (t.repeat_interleave(group, 1) for t in (kx, vx))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    with sdpa_kernel([SDPBackend.MATH]):
        o = F.scaled_dot_product_attention(qx, kx, vx, attn_mask=None if mask is None else mask[:1],
                                           is_causal=causal)
    o.backward(dout[:1].to(dtype))
    return [t.grad.float() for t in leaves]


def verdict(got, ref, low):
    bounds = [2 * (lo - r).abs().max().item() + 1e-2 * r.abs().max().item()
              for lo, r in zip(low, ref, strict=True)]
    errs = [(g[:1].float() - r).abs().max().item() for g, r in zip(got, ref, strict=True)]
    ok = all(e <= b for e, b in zip(errs, bounds, strict=True)) and all(torch.isfinite(g).all() for g in got)
    pairs = " ".join(f"{e:.1e}<={b:.1e}" for e, b in zip(errs, bounds, strict=True))
    return pairs + (" OK" if ok else " WRONG")


def inputs(B, H, Hkv, S, D, causal):
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    return (dout, q, k, v, *forward(q, k, v, causal))


def main():
    torch.manual_seed(0)
    old = load(sys.argv[1], "bwd_before")
    old_256 = load(sys.argv[2], "bwd256_before", {"flash_backend.kernels.attention_bwd_hopper import":
                                                  "bwd_before import"})
    impls = {"new": (new, new_256, None), "old": (old, old_256, None)}
    for B, H, Hkv, S, D, causal in QUICK:
        args = inputs(B, H, Hkv, S, D, causal)
        ref, low = reference(args, causal, torch.float32), reference(args, causal, torch.bfloat16)
        for name, (module, module_256, config) in impls.items():
            print(f"check {B},{H}/{Hkv},{S},{D}{' causal' if causal else ''} {name}: "
                  f"{verdict(grads(module, module_256, args, causal, config), ref, low)}", flush=True)
    print(f"{'shape':<26} {'impl':<12} {'us':>9} {'TF/s':>7} {'x cudnn':>7} {'new/old':>7}  check")
    for B, H, Hkv, S, D, causal in SHAPES:
        args = inputs(B, H, Hkv, S, D, causal)
        cases = dict(impls)
        if D == 64:
            cases["new BLOCK_M 64"] = (new, new_256, (64, 2))
        checks = {}
        if S <= 4096:
            ref, low = reference(args, causal, torch.float32), reference(args, causal, torch.bfloat16)
            checks = {name: verdict(grads(*impl[:2], args, causal, impl[2]), ref, low)
                      for name, impl in cases.items()}
        dout, q, k, v, _, _ = args
        qg = q.detach().requires_grad_()
        kg, vg = (t.repeat_interleave(H // Hkv, 1).detach().requires_grad_() for t in (k, v))

        def cudnn(backward, qg=qg, kg=kg, vg=vg, dout=dout, causal=causal):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            if backward:
                torch.autograd.grad(o, (qg, kg, vg), dout)

        graphs = {"cudnn fwd+bwd": capture_graph(lambda: cudnn(True)),
                  "cudnn fwd": capture_graph(lambda: cudnn(False))}
        for name, (module, module_256, config) in cases.items():
            graphs[name] = capture_graph(lambda m=module, m256=module_256, c=config, a=args, causal=causal:
                                 grads(m, m256, a, causal, c))
        us = interleaved_graph_us(graphs, rounds=7, reps=10)
        t_cudnn = us["cudnn fwd+bwd"] - us["cudnn fwd"]
        flops = 10 * B * H * S * S * D / (2 if causal else 1)
        shape = f"{B},{H}/{Hkv},{S},{D}{' causal' if causal else ''}"
        print(f"{shape:<26} {'cudnn bwd':<12} {t_cudnn:9.1f} {flops / t_cudnn / 1e6:7.1f}")
        for name in cases:
            t = us[name]
            print(f"{shape:<26} {name:<12} {t:9.1f} {flops / t / 1e6:7.1f} {t_cudnn / t:7.3f} "
                  f"{us['old'] / t:7.3f}  {checks.get(name, '')}", flush=True)
        del graphs


if __name__ == "__main__":
    main()
