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

    python bench/probes/attention_causal_order_probe.py
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
        cells = "  ".join(f"{name} {t:8.1f} ({us['cudnn'] / t:.3f}x)" for name, t in us.items()
                          if name != "cudnn")
        print(f"{B},{H}/{Hkv},{S},{D:<6} cudnn {us['cudnn']:8.1f}  {cells}  (shipped: waves {shipped})",
              flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    part1()
    part2()
