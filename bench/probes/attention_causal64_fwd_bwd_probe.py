"""H200: why head_dim 64 causal fwd+bwd at 8,16,2048 went from 0.77 ms (f754a4f) to 1.05 ms (71d6a63, H200)
and 1.24 ms (74f2b0b, H100) in bench_attention while its forward alone got faster: 06c797a moved that
forward to the Gluon kernel (MIN_SEQ_Q_CAUSAL_64 4096 -> 2048).

The eager step flash_attention + autograd.grad, timed as bench_attention times it (do_bench) and replayed
from a CUDA graph (GPU time alone), with the forward routed as shipped and forced onto the Triton forward;
which backward ran is counted.

    python bench/probes/attention_causal64_fwd_bwd_probe.py
"""

# ruff: noqa: B023  (each closure is timed inside the iteration that defines it)

import torch

from bench._common import bench_ms, capture_graph, interleaved_graph_us
from flash_backend.kernels import attention_bwd_hopper as gluon_bwd
from flash_backend.kernels import attention_fwd_hopper as gluon_fwd
from flash_backend.ops.attention import flash_attention

SHAPES = [(8, 16, 2048), (4, 16, 4096), (16, 16, 1024)]


def main():
    calls = {"gluon fwd": 0, "gluon bwd": 0}
    fwd_launch = gluon_fwd.attention_forward_hopper_launch
    bwd_launch = gluon_bwd.attention_backward_hopper_launch

    def count_fwd(*a, **kw):
        calls["gluon fwd"] += 1
        return fwd_launch(*a, **kw)

    def count_bwd(*a, **kw):
        calls["gluon bwd"] += 1
        return bwd_launch(*a, **kw)

    gluon_fwd.attention_forward_hopper_launch = count_fwd
    gluon_bwd.attention_backward_hopper_launch = count_bwd
    shipped = gluon_fwd.MIN_SEQ_Q_CAUSAL_64
    for B, H, S in SHAPES:
        q, k, v = (torch.randn(B, H, S, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        graphs, wall = {}, {}
        for name, min_rows in (("shipped", shipped), ("triton fwd", 1 << 30)):
            gluon_fwd.MIN_SEQ_Q_CAUSAL_64 = min_rows

            def step():
                torch.autograd.grad(flash_attention(q, k, v, is_causal=True), (q, k, v), dout)

            for key in calls:
                calls[key] = 0
            step()
            ran = dict(calls)
            wall[name] = (bench_ms(step), ran)
            graphs[name] = capture_graph(step)
        gluon_fwd.MIN_SEQ_Q_CAUSAL_64 = shipped
        gpu = interleaved_graph_us(graphs, rounds=7, reps=10)
        for name, (ms, ran) in wall.items():
            print(f"{B},{H},{S},64 causal {name:<11} do_bench {ms * 1e3:8.1f} us  graph {gpu[name]:8.1f} us  "
                  f"ran {ran}", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
