"""H200: the launch order of the causal Gluon kernels (attention_fwd_hopper._heaviest_first).

A causal CTA's work depends on its block: the forward's last query block sees every key, the backward's first
key block every query. The kernels used to take the grid as launched, a (batch, head)'s blocks heaviest
first but one (batch, head) after the other, so the heaviest CTAs of the last rows start near the end and the
kernel waits for them (a list-scheduling model of 132 SMs put that tail at 6-14 % of the bench rows). With
rows_per_group R, the launch order goes R rows at a time, rank by rank across them; R = 1 is the old order.

Part 1, each kernel alone: R swept, every R's results checked against R = 1's (forward output and logsumexp,
dK and dV: bitwise equal, each CTA computes the same tile; dQ: the reduce-adds' order varies, so close), then
all graphs replayed in interleaved rounds. Part 2, the fwd+bwd step through flash_attention with the
forward's and the backward's HEAVIEST_FIRST_WAVES at (0, 0) (R = 1), the shipped values and others, against
cuDNN's step in the same rounds. bench/logs/attention_causal_order_probe_s28_h200.log was run before the
rule took its two waves counts and its rounding down: its "rule" marks and part 2 are that of one count for
both, (HEAVIEST_FIRST_WAVES for both kernels, R = ceil(waves * SMs / blocks)).

    python bench/probes/attention_causal_order_probe.py [part ...]   (parts 1, 2, 3; all by default)
"""

# ruff: noqa: B023  (each closure is captured in a graph inside the iteration that defines it)

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench._common import capture_graph, interleaved_graph_us
from flash_backend.kernels import attention_bwd_hopper as bwd
from flash_backend.kernels import attention_bwd_hopper_256
from flash_backend.kernels import attention_fwd_hopper as fwd
from flash_backend.ops.attention import flash_attention

FWD_CASES = [  # B, H, Hkv, S, D: the causal rows of bench_attention that the Gluon forward takes
    (8, 16, 16, 2048, 128),
    (4, 16, 16, 4096, 128),
    (2, 16, 16, 8192, 128),
    (4, 32, 8, 4096, 128),
    (4, 16, 16, 4096, 64),
    (2, 16, 16, 8192, 64),
    (1, 16, 16, 16384, 256),
    (3, 5, 5, 4500, 128),  # rows not a multiple of any R swept: a short last group
]
BWD_CASES = [
    (8, 16, 16, 2048, 64),
    (2, 16, 16, 8192, 64),
    (8, 16, 16, 2048, 128),
    (4, 16, 16, 4096, 128),
    (2, 16, 16, 8192, 128),
    (4, 32, 8, 4096, 128),
    (1, 16, 16, 16384, 256),
    (3, 5, 5, 4500, 128),
]
STEP_CASES = [(8, 16, 16, 2048, 64), (2, 16, 16, 8192, 64), (8, 16, 16, 2048, 128), (4, 16, 16, 4096, 128),
              (2, 16, 16, 8192, 128), (4, 32, 8, 4096, 128), (1, 16, 16, 16384, 256)]
WAVES = [(0, 0), (4, 1), (4, 4), (2, 1), (8, 2)]  # (forward, backward)


def inputs(B, H, Hkv, S, D):
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v


def candidates(rows, default):
    return sorted({r for r in (1, 2, 4, 8, 16, 32, 64, 128, rows) if r <= rows} | {default})


def forward(q, k, v, out, lse, rows):
    fwd.attention_forward_hopper_launch(q, k, v, q.shape[-1] ** -0.5, True, out, lse, rows_per_group=rows)


def backward(q, k, v, out, lse, dout, grads, rows):
    bwd.attention_backward_hopper_launch(dout, q, k, v, out, lse, q.shape[-1] ** -0.5, True, *grads,
                                         rows_per_group=rows)


def report(case, kind, us, default, checks):
    base = us[1]
    for r, t in us.items():
        mark = " <- rule" if r == default else ""
        print(f"{case:<20} {kind:<4} R={r:<4d} {t:9.1f} us  x R=1 {base / t:6.3f}  {checks[r]}{mark}",
              flush=True)


def part1():
    print("part 1: kernels alone, GPU time by interleaved graph replay")
    for B, H, Hkv, S, D in FWD_CASES:
        q, k, v = inputs(B, H, Hkv, S, D)
        grid = (-(-S // (fwd.CONFIGS[(D, True)][3] * fwd.BLOCK_M)), B * H)
        default = fwd.heaviest_first_rows(*grid, True, q.device, fwd.HEAVIEST_FIRST_WAVES)
        results, graphs, checks = {}, {}, {}
        for r in candidates(B * H, default):
            out, lse = torch.empty_like(q), torch.empty(B, H, S, device="cuda", dtype=torch.float32)
            forward(q, k, v, out, lse, r)
            results[r] = (out, lse)
            same = torch.equal(out, results[1][0]) and torch.equal(lse, results[1][1])
            checks[r] = "same as R=1" if same else "DIFFERS from R=1"
            graphs[r] = capture_graph(lambda: forward(q, k, v, out, lse, r))
        us = interleaved_graph_us(graphs, rounds=7, reps=10)
        report(f"{B},{H}/{Hkv},{S},{D}", "fwd", us, default, checks)
    for B, H, Hkv, S, D in BWD_CASES:
        q, k, v = inputs(B, H, Hkv, S, D)
        out, lse = torch.empty_like(q), torch.empty(B, H, S, device="cuda", dtype=torch.float32)
        forward(q, k, v, out, lse, 1)
        dout = torch.randn_like(q)
        blocks = -(-S // (attention_bwd_hopper_256.KEYS if D == 256 else bwd.BLOCK_N))
        default = fwd.heaviest_first_rows(blocks, B * Hkv, True, q.device, bwd.HEAVIEST_FIRST_WAVES)
        results, graphs, checks = {}, {}, {}
        for r in candidates(B * Hkv, default):
            grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
            backward(q, k, v, out, lse, dout, grads, r)
            results[r] = grads
            dq1, dk1, dv1 = results[1]
            dq_err = ((grads[0].float() - dq1.float()).abs().max() / dq1.float().abs().max()).item()
            same = torch.equal(grads[1], dk1) and torch.equal(grads[2], dv1) and dq_err < 1e-2
            checks[r] = f"{'dK dV same, dQ close' if same else 'DIFFERS from R=1'} (dQ rel {dq_err:.1e})"
            graphs[r] = capture_graph(lambda: backward(q, k, v, out, lse, dout, grads, r))
        us = interleaved_graph_us(graphs, rounds=7, reps=5)
        report(f"{B},{H}/{Hkv},{S},{D}", "bwd", us, default, checks)


def _against_cudnn(us):
    return "  ".join(f"{name} {t:8.1f} ({us['cudnn'] / t:.3f}x)" for name, t in us.items() if name != "cudnn")


def part2():
    print("part 2: fwd+bwd step (flash_attention, autograd), GPU time, against cuDNN in the same rounds")
    shipped = fwd.HEAVIEST_FIRST_WAVES, bwd.HEAVIEST_FIRST_WAVES
    for B, H, Hkv, S, D in STEP_CASES:
        q, k, v = (t.requires_grad_() for t in inputs(B, H, Hkv, S, D))
        dout = torch.randn_like(q)
        graphs = {}
        for waves in WAVES:
            fwd.HEAVIEST_FIRST_WAVES, bwd.HEAVIEST_FIRST_WAVES = waves  # read when the step is captured
            graphs[f"waves {waves[0]},{waves[1]}"] = capture_graph(
                lambda: torch.autograd.grad(flash_attention(q, k, v, is_causal=True), (q, k, v), dout))
        fwd.HEAVIEST_FIRST_WAVES, bwd.HEAVIEST_FIRST_WAVES = shipped

        def cudnn():
            kx, vx = (t.repeat_interleave(H // Hkv, 1) for t in (k, v)) if Hkv != H else (k, v)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q, kx, vx, is_causal=True)
            torch.autograd.grad(o, (q, k, v), dout)

        graphs["cudnn"] = capture_graph(cudnn)
        us = interleaved_graph_us(graphs, rounds=7, reps=5)
        print(f"{B},{H}/{Hkv},{S},{D:<6} cudnn {us['cudnn']:8.1f}  {_against_cudnn(us)}  (shipped: waves "
              f"{shipped})", flush=True)


TRITON_CASES = [(16, 16, 16, 1024, 64), (8, 16, 16, 2048, 64), (16, 12, 12, 1024, 64), (4, 16, 16, 1024, 128)]
TRITON_WAVES = [0, 2, 4, 8, 16]


def part3():
    """The Triton kernels (the causal launches the Gluon ones do not take: head_dim 64 below 4096 query
    rows forward, 2048 backward, and problems under 2**28 scores) with attention_fwd.CAUSAL_GROUP_WAVES
    swept (0: the plain order), forward and backward alone, outputs against the plain order's; and the
    fwd+bwd step at 0 and the shipped value against cuDNN."""
    from flash_backend.kernels import attention_fwd as tri_fwd
    from flash_backend.kernels.attention_bwd import attention_backward_launch, use_atomic_dq

    print("part 3: the Triton kernels, CAUSAL_GROUP_WAVES swept (kernels alone), then the step")
    shipped = tri_fwd.CAUSAL_GROUP_WAVES
    plain_args = (None, None, 0.0, None, -1, 0, False)
    for B, H, Hkv, S, D in TRITON_CASES:
        q, k, v = inputs(B, H, Hkv, S, D)
        args = plain_args[:3] + (D ** -0.5,) + plain_args[4:]
        dout = torch.randn_like(q)
        fwd_graphs, bwd_graphs, checks, buffers = {}, {}, {}, {}
        first = None
        for waves in TRITON_WAVES:
            tri_fwd.CAUSAL_GROUP_WAVES = waves  # read when the launch is captured
            out, lse = torch.empty_like(q), torch.empty(B, H, S, device="cuda", dtype=torch.float32)
            grads = [torch.empty_like(t) for t in (q, k, v)]
            # the graphs write these: keep them (torch.cuda.graph empties the allocator's cache, and a freed
            # buffer of an earlier graph would be unmapped under its replay)
            buffers[waves] = out, lse, grads

            def run_fwd():
                tri_fwd.attention_forward_launch(q, k, v, *args, out, lse, launch=lambda kk: kk)

            def run_bwd():
                attention_backward_launch(dout, q, k, v, out, lse, *args, *grads, None, launch=lambda kk: kk,
                                          atomic_dq=use_atomic_dq(D, 0.0, False, False))

            run_fwd()
            run_bwd()
            first = first or (out.clone(), [g.clone() for g in grads])
            dq_err = ((grads[0].float() - first[1][0].float()).abs().max()).item()
            kv_same = all(torch.equal(a, b) for a, b in zip(grads[1:], first[1][1:], strict=True))
            same = torch.equal(out, first[0]) and kv_same
            checks[waves] = f"{'out dK dV same' if same else 'DIFFERS'}, dQ diff {dq_err:.1e}"
            fwd_graphs[waves] = capture_graph(run_fwd)
            bwd_graphs[waves] = capture_graph(run_bwd)
        tri_fwd.CAUSAL_GROUP_WAVES = shipped
        for kind, graphs in (("fwd", fwd_graphs), ("bwd", bwd_graphs)):
            us = interleaved_graph_us(graphs, rounds=9, reps=10)
            for waves, t in us.items():
                mark = " <- shipped" if waves == shipped else ""
                print(f"{B},{H}/{Hkv},{S},{D:<8} {kind} waves {waves:<3d} {t:8.1f} us  "
                      f"x plain {us[0] / t:6.3f}  {checks[waves]}{mark}", flush=True)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        steps = {}
        for waves in (0, shipped):
            tri_fwd.CAUSAL_GROUP_WAVES = waves
            steps[f"waves {waves}"] = capture_graph(
                lambda: torch.autograd.grad(flash_attention(q, k, v, is_causal=True), (q, k, v), dout))
        tri_fwd.CAUSAL_GROUP_WAVES = shipped

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(o, (q, k, v), dout)

        steps["cudnn"] = capture_graph(cudnn)
        us = interleaved_graph_us(steps, rounds=9, reps=10)
        print(f"{B},{H}/{Hkv},{S},{D:<8} step: cudnn {us['cudnn']:8.1f}  {_against_cudnn(us)}", flush=True)


if __name__ == "__main__":
    import sys

    torch.manual_seed(0)
    parts = sys.argv[1:] or ["1", "2", "3"]
    for part in parts:
        {"1": part1, "2": part2, "3": part3}[part]()
