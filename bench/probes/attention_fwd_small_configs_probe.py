"""H200: the Triton kernels' tiles at the short rows they keep (head_dim 64 below 2048 query rows, ViT, BERT).

FWD_CONFIGS / DKDV_CONFIGS / DQ_CONFIGS were swept at 8,16,2048 (bench_attention --sweep); the rows below
run the same tiles. Per shape, every (BLOCK_M, BLOCK_N, warps, stages) candidate, kernels alone, as CUDA
graphs replayed in interleaved rounds with cuDNN's forward (backward: cuDNN's fwd+bwd minus its forward) as
the anchor; each candidate's output or gradients checked against fp32 first.

    PYTHONPATH=. python bench/probes/attention_fwd_small_configs_probe.py
"""

# ruff: noqa: B023  (each closure is captured inside the iteration that defines it)

import itertools
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench._common import bench_ms, capture_graph, interleaved_graph_us
from flash_backend.kernels import attention_fwd

SHAPES = [(16, 16, 1024, 64, False), (16, 16, 1024, 64, True), (16, 12, 1024, 64, True),
          (64, 12, 197, 64, False), (32, 12, 512, 64, False)]
CANDIDATES = [*itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)), (128, 64, 8, 4), (64, 64, 4, 4)]
# the backward's shapes on the Triton backward (the Gluon one takes 16,16,1024,64 non-causal)
BWD_SHAPES = [(16, 16, 1024, 64, True), (64, 12, 197, 64, False)]
TILES = [*itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3))]
DKDV_CANDIDATES = [c for c in TILES if c[0] <= 64 and c[1] >= 64]
DQ_CANDIDATES = [c for c in TILES if c[0] >= 64 and c[1] <= 64]


def _timed_candidates(candidates, make_step, error_of):
    """{candidate: GPU us} of each candidate that runs, and {candidate: error}: make_step(cfg) -> (step,
    buffers it writes), error_of(buffers) -> its error against fp32. Each candidate is checked, captured and
    replayed alone first; then all in interleaved rounds."""
    graphs, errors, keep = {}, {}, []
    for cfg in candidates:
        step, buffers = make_step(cfg)
        try:
            step()
            torch.cuda.synchronize()
        except Exception as e:  # out of shared memory etc.: report and go on
            print(f"  {cfg}: FAIL {type(e).__name__} {str(e)[:80]}")
            continue
        errors[cfg] = error_of(buffers)
        print(f"  replaying {cfg}", flush=True)  # the last line before a fault names the tile
        graphs[cfg] = capture_graph(step)
        keep.append(buffers)  # graph_replay_fault_probe.py: a graph must not outlive its buffers
        for _ in range(3):
            graphs[cfg].replay()
        torch.cuda.synchronize()
        errors[cfg] = max(errors[cfg], error_of(buffers))
    return interleaved_graph_us(graphs, rounds=7, reps=20), errors


def _report(title, us, errors, current):
    base = us[current]
    print(f"== {title}: current {current} {base:.1f} us; error of current {errors[current]:.2e}", flush=True)
    for t, c in sorted((t, c) for c, t in us.items())[:8]:
        print(f"  {c}: {t:8.1f} us  x current {base / t:.3f}  err {errors[c]:.2e}", flush=True)
    return base


def forward_sweep(shapes, candidates=CANDIDATES):
    for B, H, S, D, causal in shapes:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        scale = D ** -0.5
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        current = attention_fwd.fwd_config(D, causal)

        def make_step(cfg):
            out = torch.empty_like(q)
            lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)

            def step():
                attention_fwd.attention_forward_launch(q, k, v, None, None, 0.0, scale, -1,
                                                       0 if causal else -1, False, out, lse, config=cfg)

            return step, (out, lse)

        us, errors = _timed_candidates([current] + [c for c in candidates if c != current], make_step,
                                       lambda bufs: (bufs[0].float() - ref).abs().max().item())
        base = _report(f"{B},{H},{S},{D} causal={causal}", us, errors, current)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        cudnn_us = bench_ms(capture_graph(cudnn).replay) * 1e3
        print(f"  cuDNN's forward {cudnn_us:.1f} us: current x cuDNN {cudnn_us / base:.3f}, best x cuDNN "
              f"{cudnn_us / min(us.values()):.3f}", flush=True)


def backward_sweep(shapes=BWD_SHAPES, candidates=None):
    """candidates: (dK/dV, dQ) config pairs; by default the current pair, then each tile of DKDV_CANDIDATES
    with the current dQ tile and each of DQ_CANDIDATES with the current dK/dV tile."""
    from flash_backend.kernels import attention_bwd

    for B, H, S, D, causal in shapes:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
        scale = D ** -0.5
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = torch.autograd.grad(F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal), (qf, kf, vf),
                                  dout.float())
        out = torch.empty_like(q)
        lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
        wr = 0 if causal else -1
        attention_fwd.attention_forward_launch(q, k, v, None, None, 0.0, scale, -1, wr, False, out, lse)
        current = attention_bwd.default_configs(D, 0.0, False)
        if candidates is None:
            cands = [current] + [(c, current[1]) for c in DKDV_CANDIDATES if c != current[0]]
            cands += [(current[0], c) for c in DQ_CANDIDATES if c != current[1]]
        else:
            cands = [current] + [c for c in candidates if c != current]

        def make_step(cfg):
            grads = tuple(torch.empty_like(t) for t in (q, k, v))

            def step():
                attention_bwd.attention_backward_launch(dout, q, k, v, out, lse, None, None, 0.0, scale, -1,
                                                        wr, False, *grads, None, config=cfg)

            return step, grads

        def rel_error(grads):
            return max(((g.float() - r).abs().max() / r.abs().max()).item()
                       for g, r in zip(grads, ref, strict=True))

        us, errors = _timed_candidates(cands, make_step, rel_error)
        base = _report(f"bwd {B},{H},{S},{D} causal={causal}", us, errors, current)
        qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))

        def cudnn_fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)

        def cudnn_step():
            torch.autograd.grad(cudnn_fwd(), (qd, kd, vd), dout)

        step_ms = bench_ms(capture_graph(cudnn_step).replay)
        cudnn_bwd = (step_ms - bench_ms(capture_graph(cudnn_fwd).replay)) * 1e3
        print(f"  cuDNN's backward {cudnn_bwd:.1f} us: current x cuDNN {cudnn_bwd / base:.3f}, best x cuDNN "
              f"{cudnn_bwd / min(us.values()):.3f}", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    if sys.argv[1:] == ["short"]:  # where the short-key tile stops paying, and ViT's backward tiles
        lengths = (64, 128, 197, 256, 257, 320, 384)
        forward_sweep([(64, 12, s, 64, False) for s in lengths], [(128, 64, 8, 3), (128, 32, 4, 3)])
        backward_sweep([(64, 12, 197, 64, False)])
        sys.exit()
    if sys.argv[1:] == ["bwd-short"]:  # ViT's dK/dV tile (session 35: 1.122x at 197 keys) over key lengths
        lengths = (64, 128, 197, 256, 257, 320, 384, 512)
        dkdv = [(64, 64, 4, 2), (32, 64, 4, 3), (32, 64, 4, 2), (32, 128, 4, 3)]
        backward_sweep([(64, 12, s, 64, False) for s in lengths], [(c, (64, 64, 4, 2)) for c in dkdv])
        sys.exit()
    # argv: indices into SHAPES to sweep (default all), "bwd" for the backward sweep only
    picked = [SHAPES[int(a)] for a in sys.argv[1:] if a.isdigit()] or SHAPES
    if "bwd" not in sys.argv[1:]:
        forward_sweep(picked)
    backward_sweep()
