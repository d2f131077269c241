"""H200: would the Gluon kernels serve bench_attention's small rows (ViT-base, 16,16,1024,64 causal, BERT's
shape without its mask)? They are kept off there (MIN_SCORES and the head_dim-64 lengths) because a Gluon
launch costs more host time; but ViT's Triton backward is GPU-bound (179 us of GPU, session 24).

Per shape and routing: the fwd+bwd step's GPU time (CUDA graph replay, interleaved rounds), the forward's
alone, and the eager step's wall time (what bench_attention times), against cuDNN in the same rounds. The
thresholds are lowered by patching the modules' constants for the variants that need it."""

# ruff: noqa: B023  (each closure is captured or timed inside the iteration that defines it)

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench._common import capture_graph, interleaved_graph_us
from flash_backend import config
from flash_backend.kernels import attention_bwd_hopper as bwd_hopper
from flash_backend.kernels import attention_fwd_hopper as fwd_hopper
from flash_backend.ops.attention import flash_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _timing  # noqa: E402  (bench/probes/_timing.py, beside this file)

SHAPES = [(64, 12, 197, 64, False), (16, 16, 1024, 64, True), (32, 12, 512, 64, False),
          (16, 16, 1024, 64, False)]
# name: (Gluon forward config or None for the Triton forward, Gluon backward?)
VARIANTS = {
    "triton/triton": (None, False),
    "triton/gluon": (None, True),
    "gluon c2/gluon": ((128, 2, True, 2), True),
    "gluon c3/gluon": ((128, 2, False, 3), True),
}


def route(fwd_config, gluon_bwd, causal):
    """Set the routing for one variant: thresholds off, the forward's config for (64, causal)."""
    fwd_hopper.MIN_SCORES = 0
    fwd_hopper.MIN_SEQ_Q_THREE_CONSUMERS = 0
    fwd_hopper.MIN_SEQ_Q_CAUSAL_64 = 0
    bwd_hopper.MIN_SEQ_Q_CAUSAL_64 = 0
    config.hopper_attention_forward = fwd_config is not None
    config.hopper_attention_backward = gluon_bwd
    if fwd_config is not None:
        fwd_hopper.CONFIGS[(64, causal)] = fwd_config


def main():
    saved = (fwd_hopper.MIN_SCORES, fwd_hopper.MIN_SEQ_Q_THREE_CONSUMERS, fwd_hopper.MIN_SEQ_Q_CAUSAL_64,
             bwd_hopper.MIN_SEQ_Q_CAUSAL_64, dict(fwd_hopper.CONFIGS))
    for B, H, S, D, causal in SHAPES:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        ref = [t.float() for t in flash_attention(q, k, v, is_causal=causal).detach().split(1)]
        steps, fwds, eager = {}, {}, {}

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        variants = {"cudnn": cudnn}
        for name, (fwd_config, gluon_bwd) in VARIANTS.items():
            variants[name] = (fwd_config, gluon_bwd)
        for name, how in variants.items():
            if callable(how):
                fn = how
            else:
                route(*how, causal)

                def fn():
                    return flash_attention(q, k, v, is_causal=causal)

                out = fn().detach()
                err = max((o.float() - r).abs().max().item() for o, r in zip(out.split(1), ref, strict=True))
                assert err < 3e-2, (name, err)

            def step():
                torch.autograd.grad(fn(), (q, k, v), dout)

            steps[name] = capture_graph(step)
            fwds[name] = capture_graph(fn)
            eager[name] = _timing.step_us(fn, (q, k, v), dout, n=200)[1]
            (fwd_hopper.MIN_SCORES, fwd_hopper.MIN_SEQ_Q_THREE_CONSUMERS, fwd_hopper.MIN_SEQ_Q_CAUSAL_64,
             bwd_hopper.MIN_SEQ_Q_CAUSAL_64, configs) = saved
            fwd_hopper.CONFIGS.clear()
            fwd_hopper.CONFIGS.update(configs)
            config.hopper_attention_forward = config.hopper_attention_backward = True
        step_gpu = interleaved_graph_us(steps, rounds=7, reps=20)
        fwd_gpu = interleaved_graph_us(fwds, rounds=7, reps=20)
        print(f"\n{B},{H},{S},{D} causal={causal}: us (x cuDNN = cuDNN's / ours)", flush=True)
        print(f"{'routing':<16} {'step GPU':>9} {'x':>6} {'fwd GPU':>8} {'x':>6} {'eager step':>10} {'x':>6}")
        for name in variants:
            print(f"{name:<16} {step_gpu[name]:9.1f} {step_gpu['cudnn'] / step_gpu[name]:6.2f} "
                  f"{fwd_gpu[name]:8.1f} {fwd_gpu['cudnn'] / fwd_gpu[name]:6.2f} {eager[name]:10.1f} "
                  f"{eager['cudnn'] / eager[name]:6.2f}", flush=True)


if __name__ == "__main__":
    main()
