"""H200: which backward to route at head_dim 64 — the Gluon one (kernels/attention_bwd_hopper.py) or the
Triton one (kernels/attention_bwd.py) — measured in the fwd+bwd step, against cuDNN in the same rounds.

Each step is captured in a CUDA graph (GPU time alone; the routing is decided when the step is captured) and
replayed in interleaved rounds. Session 24 found 16,16,1024,64 non-causal GPU-bound with the Gluon backward at
585 us against cuDNN's ~496; the Triton backward was never timed there."""

# ruff: noqa: B023  (each closure is captured in a graph inside the iteration that defines it)

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench._common import capture_graph, interleaved_graph_us
from flash_backend import config
from flash_backend.ops.attention import flash_attention

SHAPES = [  # B, H, S, D, causal
    (16, 16, 1024, 64, False),
    (16, 16, 1024, 64, True),
    (8, 16, 2048, 64, False),
    (8, 16, 2048, 64, True),
    (4, 16, 4096, 64, False),
    (4, 16, 4096, 64, True),
    (2, 16, 8192, 64, True),
    (8, 16, 2048, 128, False),
]


def step_graph(fn, q, k, v, dout):
    def step():
        torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    return capture_graph(step)


def main():
    print(f"{'B,H,S,D':>16} {'causal':>6} | {'gluon us':>9} {'triton us':>9} {'cudnn us':>9} | "
          f"{'gluon/cudnn':>11} {'triton/cudnn':>12}", flush=True)
    for B, H, S, D, causal in SHAPES:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        graphs = {}
        for name, gluon_bwd in (("gluon", True), ("triton", False)):
            config.hopper_attention_backward = gluon_bwd
            ours = lambda a, b, c: flash_attention(a, b, c, is_causal=causal)  # noqa: E731
            graphs[name] = step_graph(ours, q, k, v, dout)
        config.hopper_attention_backward = True

        def cudnn(a, b, c):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(a, b, c, is_causal=causal)

        graphs["cudnn"] = step_graph(cudnn, q, k, v, dout)
        us = interleaved_graph_us(graphs, rounds=9, reps=20)
        print(f"{f'{B},{H},{S},{D}':>16} {causal!s:>6} | {us['gluon']:9.1f} {us['triton']:9.1f} "
              f"{us['cudnn']:9.1f} | {us['cudnn'] / us['gluon']:11.3f} {us['cudnn'] / us['triton']:12.3f}",
              flush=True)


if __name__ == "__main__":
    main()
