"""H200: head_dim 64 causal, the Gluon kernels against the Triton ones below the Gluon routing's lengths
(attention_fwd_hopper.MIN_SEQ_Q_CAUSAL_64 = 4096 forward, attention_bwd_hopper.MIN_SEQ_Q_CAUSAL_64 = 2048
backward), now that both launch heaviest-first by groups of rows (session 28). Session 25 had the best Gluon
forward at 0.994x the Triton one at 8,16,2048 and the Gluon backward at 0.97x at 16,16,1024.

Each kernel alone, captured in a CUDA graph and replayed in interleaved rounds; every Gluon result checked
against the Triton kernels' (output within bf16 rounding, gradients close).

    python bench/probes/attention_causal64_routing_probe.py
"""

# ruff: noqa: B023  (each closure is captured in a graph inside the iteration that defines it)

import torch

from bench._common import capture_graph, interleaved_graph_us
from flash_backend.kernels import attention_bwd_hopper as gluon_bwd
from flash_backend.kernels import attention_fwd_hopper as gluon_fwd
from flash_backend.kernels.attention_bwd import attention_backward_launch
from flash_backend.kernels.attention_fwd import attention_forward_launch

SHAPES = [(16, 16, 1024), (8, 16, 2048), (4, 16, 4096)]  # B, H, S at head_dim 64, causal
# (BLOCK_N, STAGES, PINGPONG, CONSUMERS, RAW_SCORES); session 30 added the RAW_SCORES ones (the routed
# configuration since 946d3b3 first)
GLUON_FWD_CONFIGS = [(128, 2, False, 3, True), (64, 2, False, 3, True), (128, 2, True, 2, True),
                     (128, 2, False, 3), (64, 2, False, 2)]
ARGS = (None, None, 0.0, 0.125, -1, 0, False)  # no mask, no dropout, scale, causal top-left


def main():
    print(f"{'B,H,S':>12} {'kernel':<28} {'us':>8} {'x triton':>8}  check", flush=True)
    for B, H, S in SHAPES:
        q, k, v = (torch.randn(B, H, S, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn_like(q)
        keep = []  # the graphs write these buffers: they must outlive the captures (which empty the cache)

        def buffers():
            out, lse = torch.empty_like(q), torch.empty(B, H, S, device="cuda", dtype=torch.float32)
            keep.append((out, lse))
            return out, lse

        ref_out, ref_lse = buffers()
        attention_forward_launch(q, k, v, *ARGS, ref_out, ref_lse)
        fwd = {"triton fwd": capture_graph(
            lambda: attention_forward_launch(q, k, v, *ARGS, ref_out, ref_lse))}
        checks = {"triton fwd": ""}
        for cfg in GLUON_FWD_CONFIGS:
            out, lse = buffers()
            gluon_fwd.attention_forward_hopper_launch(q, k, v, 0.125, True, out, lse, config=cfg)
            err = (out.float() - ref_out.float()).abs().max().item()
            lse_err = (lse - ref_lse).abs().max().item()
            name = f"gluon fwd {cfg}"
            ok = err < 2e-2 and lse_err < 1e-3
            checks[name] = f"out {err:.1e} lse {lse_err:.1e}" + ("" if ok else " WRONG")
            fwd[name] = capture_graph(
                lambda: gluon_fwd.attention_forward_hopper_launch(q, k, v, 0.125, True, out, lse, config=cfg))
        grads_t = [torch.empty_like(t) for t in (q, k, v)]
        grads_g = [torch.empty_like(t) for t in (q, k, v)]
        attention_backward_launch(dout, q, k, v, ref_out, ref_lse, *ARGS, *grads_t, None)
        gluon_bwd.attention_backward_hopper_launch(dout, q, k, v, ref_out, ref_lse, 0.125, True, *grads_g)
        rel = max(((g.float() - t.float()).norm() / t.float().norm()).item()
                  for g, t in zip(grads_g, grads_t, strict=True))
        bwd = {"triton bwd": capture_graph(
                   lambda: attention_backward_launch(dout, q, k, v, ref_out, ref_lse, *ARGS, *grads_t, None)),
               "gluon bwd": capture_graph(
                   lambda: gluon_bwd.attention_backward_hopper_launch(dout, q, k, v, ref_out, ref_lse, 0.125,
                                                                      True, *grads_g))}
        checks["triton bwd"] = ""
        checks["gluon bwd"] = f"grads rel {rel:.1e}" + ("" if rel < 2e-2 else " WRONG")
        for graphs, base in ((fwd, "triton fwd"), (bwd, "triton bwd")):
            us = interleaved_graph_us(graphs, rounds=9, reps=10)
            for name, t in us.items():
                print(f"{f'{B},{H},{S}':>12} {name:<28} {t:8.1f} {us[base] / t:8.3f}  {checks[name]}",
                      flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
