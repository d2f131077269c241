"""Linear + bias + GELU on the H200, bf16: flash (cuBLASLt epilogues or the Triton matmul, as measured per
problem) vs eager, Inductor, Inductor
max-autotune and torch._addmm_activation (forward only), forward and forward+backward, in one run.

    python bench/bench_dense.py [--approximate tanh,none] [--autotune-shapes 2] [--autotune-budget-s 240]
    python bench/bench_dense.py --gelu-backward   # GELU's backward pass alone, and its launch sweep
    python bench/bench_dense.py --gelu-forward    # the erf GELU's forward pass alone, against a copy

Two timings per row: `ms`, the call from Python (do_bench), and `graph_ms`, the same step captured in a
CUDA graph and replayed: the GPU time alone, the implementations of a case replayed in interleaved rounds
(one after the other, the same GEMMs measured up to 10 % apart as the chip's clock drifted). At K=768 the
Python side of every implementation is as long as its kernels on the lent H200 host and varies by +-30 %
between runs (bench/NOTES_dense.md), so the table's ratios are on GPU time, the time a compiled model's
graph pays.

Inductor max-autotune compiles for minutes per shape: it runs on the first --autotune-shapes shapes at
M=16384 (see SHAPES), and stops once --autotune-budget-s is spent; the table says which ran.
Writes bench/results/dense.json and prints a markdown table last.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    Results,
    bench_ms,
    capture_graph,
    capture_graph_or_none,
    interleaved_graph_us,
    markdown_table,
)
from flash_backend.ops.dense import linear_bias_gelu  # noqa: E402

# (K, N): GPT-2 small, GPT-2 XL, a 4096-wide model; M = tokens per step.
SHAPES = [(768, 3072), (1600, 6400), (4096, 16384)]
MS = [16384, 8192]
DTYPE = torch.bfloat16


def _eager(approximate):
    def fn(x, w, b):
        return F.gelu(F.linear(x, w, b), approximate=approximate)

    return fn


def _ours(approximate):
    def fn(x, w, b):
        return linear_bias_gelu(x, w, b, approximate)

    return fn


def _addmm_activation(x, w, b):
    # cuBLASLt's GELU epilogue: the tanh approximation, forward only (no autograd formula).
    return torch._addmm_activation(b, x, w.t(), use_gelu=True)


def _compiled(fn, mode):
    torch._dynamo.reset()  # a fresh cache per case: no recompile limit, no stale graph
    return torch.compile(fn, mode=mode, dynamic=False)


def _make(impl, approximate):
    if impl == "flash":
        return _ours(approximate)
    if impl == "eager":
        return _eager(approximate)
    if impl == "inductor":
        return _compiled(_eager(approximate), None)
    if impl == "inductor_max_autotune":
        return _compiled(_eager(approximate), "max-autotune-no-cudagraphs")
    return _addmm_activation


def _time(fn, x, w, b, grad, train):
    """(ms called from Python, the step captured in a CUDA graph or None)."""
    if train:
        leaves = (x, w, b)
        step = lambda: torch.autograd.grad(fn(x, w, b), leaves, grad)
    else:
        step = lambda: fn(x, w, b)
    step()  # compile / build / autotune (and our per-problem forward choice) outside the timing
    torch.cuda.synchronize()
    return bench_ms(step), capture_graph_or_none(step)


def profile(m, k, n, approximate="tanh"):
    """Kernel-by-kernel times of one fwd+bwd step, flash and eager (where the time goes)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    x = torch.randn(m, k, dtype=DTYPE, device="cuda", requires_grad=True)
    w = (torch.randn(n, k, dtype=DTYPE, device="cuda") / k**0.5).requires_grad_()
    b = torch.randn(n, dtype=DTYPE, device="cuda", requires_grad=True)
    grad = torch.randn(m, n, dtype=DTYPE, device="cuda")
    for impl in ("flash", "eager"):
        fn = _make(impl, approximate)
        for _ in range(3):
            torch.autograd.grad(fn(x, w, b), (x, w, b), grad)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                torch.autograd.grad(fn(x, w, b), (x, w, b), grad)
            torch.cuda.synchronize()
        print(f"\n## profile {impl} M={m} K={k} N={n} {approximate}, 5 fwd+bwd steps")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=70))


def _backward_pieces_at(m, k, n):
    x = torch.randn(m, k, dtype=DTYPE, device="cuda")
    g = torch.randn(m, n, dtype=DTYPE, device="cuda")
    pre = torch.randn(m, n, dtype=DTYPE, device="cuda")
    t = {
        "wgrad cuBLASLt BGRADB": bench_ms(lambda: torch.ops.flash.cublaslt_linear_wgrad_bgrad(g, x)),
        "wgrad mm + sum(0)": bench_ms(lambda: (g.t() @ x, g.sum(0))),
        "wgrad mm": bench_ms(lambda: g.t() @ x),
        "aten gelu_backward + sum(0)": bench_ms(
            lambda: torch.ops.aten.gelu_backward(g, pre, approximate="tanh").sum(0)),
    }
    print(f"M={m} K={k} N={n}: " + ", ".join(f"{name} {ms * 1e3:.0f} us" for name, ms in t.items()))


def backward_pieces():
    """The weight-gradient choices (BGRADB epilogue or GEMM + column sum) side by side (NOTES_dense.md)."""
    from flash_backend.ops.dense import _extension

    _extension()
    for k, n in SHAPES:
        _backward_pieces_at(MS[0], k, n)


def _forward_impls(x, w, b, approximate, store_pre) -> dict:
    from flash_backend.ops import dense

    impls = {"cublaslt": lambda: dense._cublaslt_linear_gelu(x, w, b, approximate, store_pre),
             "cublaslt_gemm_bias_only": lambda: torch.ops.flash.cublaslt_linear(x, w, b)}
    for c in ((128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 4, 4)):
        impls["triton_" + "x".join(map(str, c))] = (
            lambda c=c: dense.triton_linear_gelu(x, w, b, approximate, store_pre, c))
    return impls


def forward_paths():
    """The forward's implementations side by side per problem, GPU time: cuBLASLt (GELU_AUX_BIAS for tanh,
    BIAS + an erf GELU pass for none), each Triton config, and the bare cuBLASLt GEMM + bias for scale."""
    from flash_backend.ops import dense

    dense._extension()
    results = Results("dense_forward_paths")
    for m in MS:
        for k, n in [*SHAPES, (3072, 768)]:
            x = torch.randn(m, k, dtype=DTYPE, device="cuda")
            w = torch.randn(n, k, dtype=DTYPE, device="cuda") / k**0.5
            b = torch.randn(n, dtype=DTYPE, device="cuda")
            for approximate in ("none", "tanh"):
                for store_pre in (True, False):
                    case = {"M": m, "K": k, "N": n, "dtype": "bf16", "approximate": approximate,
                            "store_pre": store_pre}
                    line = []
                    for impl, fn in _forward_impls(x, w, b, approximate, store_pre).items():
                        ms = bench_ms(fn)
                        results.add(impl, "fwd", case, ms, tflops=2 * m * k * n / ms / 1e9)
                        line.append(f"{impl} {ms * 1e3:.0f} us")
                    print(f"M={m} K={k} N={n} {approximate} store_pre={store_pre:d}: " + ", ".join(line),
                          flush=True)
            results.write()
    print(f"wrote {results.write()}")


# (BLOCK_M, BLOCK_N, num_warps, programs per SM, loop stages, erf GELU's CDF by polynomial) candidates of
# the GELU' + bias-gradient pass: session 10's pick, then the best of the sweeps at N = 3072
# (bench/logs/dense_gelu_backward_sweep*_h200.log) for tanh and for erf, and runners-up.
GELU_BWD_CANDIDATES = [(32, 128, 4, 8, 2, True), (16, 128, 4, 8, 2, True), (16, 128, 4, 16, 2, True),
                       (8, 256, 2, 16, 3, True), (32, 128, 4, 8, 3, True), (16, 256, 4, 8, 3, True)]


def _gelu_backward_at(results: Results, pre: torch.Tensor, grad: torch.Tensor, approximate: str) -> dict:
    """GPU time (CUDA graphs replayed in interleaved rounds) of each implementation of grad_pre = grad *
    GELU'(pre) plus its column sums: {name: ms}."""
    from flash_backend.ops import dense

    m, n = pre.shape
    case = {"M": m, "N": n, "dtype": "bf16", "approximate": approximate}
    moved = 3 * pre.numel() * pre.element_size()  # read grad and pre, write grad_pre

    def reference(g, p):
        grad_pre = torch.ops.aten.gelu_backward(g, p, approximate=approximate)
        return grad_pre, grad_pre.sum(0)

    torch._dynamo.reset()
    compiled = torch.compile(reference, dynamic=False)
    impls = {"aten": lambda: reference(grad, pre), "inductor": lambda: compiled(grad, pre)}
    for c in GELU_BWD_CANDIDATES:
        impls["flash_" + "x".join(map(str, c))] = (
            lambda c=c: dense.gelu_backward_dbias(grad, pre, approximate, config=c))
    graphs = {}
    for impl, fn in impls.items():
        fn()
        graph = capture_graph_or_none(fn)
        if graph is not None:
            graphs[impl] = graph
    # interleaved rounds, as _gelu_forward_at: timed one after the other, the clock drifts between candidates
    times = {impl: us / 1e3 for impl, us in interleaved_graph_us(graphs).items()}
    for impl, ms in times.items():
        results.add(impl, "bwd", case, ms, tbps=moved / ms / 1e9, graph_ms=ms)
    print(f"M={m} N={n} {approximate}: " + ", ".join(
        f"{impl} {ms * 1e3:.1f} us ({moved / ms / 1e9:.2f} TB/s)" for impl, ms in times.items()), flush=True)
    return times


def gelu_backward_sweep():
    """GELU's backward with the bias gradient alone: each launch candidate of our pass against
    aten.gelu_backward + .sum(0) and Inductor's compile of the same, GPU time, TB/s on the bytes that must
    move; last, the candidates ranked by their geometric-mean speed over aten."""
    results = Results("dense_gelu_backward")
    ratios: dict[str, list[float]] = {}
    for m, n in [(16384, 3072), (8192, 3072), (16384, 6400), (16384, 16384), (12608, 3072)]:
        pre = torch.randn(m, n, dtype=DTYPE, device="cuda") * 2
        grad = torch.randn(m, n, dtype=DTYPE, device="cuda")
        for approximate in ("none", "tanh"):
            times = _gelu_backward_at(results, pre, grad, approximate)
            for impl, ms in times.items():
                ratios.setdefault(impl, []).append(times["aten"] / ms)
        results.write()
    ranked = sorted(ratios, key=lambda impl: -math.prod(ratios[impl]) ** (1 / len(ratios[impl])))
    for impl in ranked:
        r = ratios[impl]
        print(f"RANK {impl:24s} x aten: geomean {math.prod(r) ** (1 / len(r)):.3f}, min {min(r):.3f}")
    print(f"wrote {results.write()}")


# (BLOCK, num_warps, polynomial CDF) candidates of the erf GELU's forward pass; the last is libdevice's erf.
GELU_FWD_CANDIDATES = [(1024, 4, True), (2048, 4, True), (2048, 8, True), (4096, 8, True), (2048, 8, False)]


def _gelu_forward_at(results: Results, pre: torch.Tensor) -> dict:
    """GPU time of each implementation of the erf GELU's forward on pre, CUDA graphs timed interleaved:
    {name: us}; each one's max abs error against fp64 goes into its row."""
    from flash_backend.ops import dense

    m, n = pre.shape
    out = torch.empty_like(pre)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: F.gelu(t), dynamic=False)
    impls = {"copy": lambda: out.copy_(pre), "aten": lambda: F.gelu(pre), "inductor": lambda: compiled(pre)}
    for c in GELU_FWD_CANDIDATES:
        impls["flash_" + "x".join(map(str, c))] = lambda c=c: dense.gelu_erf_forward(pre, out, config=c)
    expected = F.gelu(pre.double())
    errors = {impl: (fn().double() - expected).abs().max().item()
              for impl, fn in impls.items() if impl != "copy"}
    us = interleaved_graph_us({impl: capture_graph(fn) for impl, fn in impls.items()})
    moved = 2 * pre.numel() * pre.element_size()
    case = {"M": m, "N": n, "dtype": "bf16", "approximate": "none"}
    for impl, t in us.items():
        results.add(impl, "fwd", case, t / 1e3, tbps=moved / t / 1e6, graph_ms=t / 1e3,
                    max_abs_err=errors.get(impl))
    cells = [f"{impl} {t:.1f} us ({moved / t / 1e6:.2f} TB/s, err {errors.get(impl, 0):.1e})"
             for impl, t in us.items()]
    print(f"M={m} N={n}: " + ", ".join(cells), flush=True)
    return us


def gelu_forward_sweep():
    """The erf GELU's forward pass alone: each launch candidate of ours against aten's F.gelu, Inductor's
    compile of it and a copy of the same bytes (the ceiling), TB/s on the bytes that must move (read pre,
    write out); last, the candidates ranked by their geometric-mean speed over Inductor."""
    results = Results("dense_gelu_forward")
    ratios: dict[str, list[float]] = {}
    for m, n in [(16384, 3072), (12608, 3072), (8192, 3072), (16384, 6400), (8192, 16384)]:
        us = _gelu_forward_at(results, torch.randn(m, n, dtype=DTYPE, device="cuda") * 2)
        for impl, t in us.items():
            ratios.setdefault(impl, []).append(us["inductor"] / t)
        results.write()
    for impl, r in ratios.items():
        print(f"RANK {impl:20s} x inductor: geomean {math.prod(r) ** (1 / len(r)):.3f}, min {min(r):.3f}")
    print(f"wrote {results.write()}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--approximate", default="tanh,none")
    parser.add_argument("--autotune-shapes", type=int, default=2)
    parser.add_argument("--autotune-budget-s", type=float, default=240.0)
    parser.add_argument("--profile", action="store_true", help="profile fwd+bwd at K=768 first")
    parser.add_argument("--forward-paths", action="store_true",
                        help="only the forward's implementations side by side (dense_forward_paths.json)")
    parser.add_argument("--gelu-backward", action="store_true",
                        help="only GELU's backward pass and its launch sweep (dense_gelu_backward.json)")
    parser.add_argument("--gelu-forward", action="store_true",
                        help="only the erf GELU's forward pass and its launches (dense_gelu_forward.json)")
    args = parser.parse_args()
    if args.gelu_forward:
        gelu_forward_sweep()
        return
    if args.gelu_backward:
        gelu_backward_sweep()
        return
    if args.forward_paths:
        forward_paths()
        return
    if args.profile:
        backward_pieces()
        for m in MS:
            profile(m, 768, 3072)
    approximations = args.approximate.split(",")

    results = Results("dense")
    table = []
    autotune_left = args.autotune_budget_s
    for approximate in approximations:
        for m in MS:
            for i, (k, n) in enumerate(SHAPES):
                case = {"M": m, "K": k, "N": n, "dtype": "bf16", "approximate": approximate}
                x = torch.randn(m, k, dtype=DTYPE, device="cuda")
                w = torch.randn(n, k, dtype=DTYPE, device="cuda") / k**0.5
                b = torch.randn(n, dtype=DTYPE, device="cuda")
                grad = torch.randn(m, n, dtype=DTYPE, device="cuda")
                for train in (False, True):
                    mode = "fwd+bwd" if train else "fwd"
                    flops = (6 if train else 2) * m * n * k
                    for t in (x, w, b):
                        t.requires_grad_(train)
                    impls = ["flash", "eager", "inductor"]
                    if (approximate == approximations[0] and m == MS[0] and i < args.autotune_shapes
                            and autotune_left > 0):
                        impls.append("inductor_max_autotune")
                    if not train and approximate == "tanh":
                        impls.append("addmm_activation")
                    call_ms, graphs = {}, {}
                    for impl in impls:
                        t0 = time.perf_counter()
                        call_ms[impl], graph = _time(_make(impl, approximate), x, w, b, grad, train)
                        if graph is not None:
                            graphs[impl] = graph
                        if impl == "inductor_max_autotune":
                            autotune_left -= time.perf_counter() - t0
                    # GPU time of all implementations in interleaved rounds: timed one after the other, the
                    # same GEMMs measured up to 10 % apart as the chip's clock drifted (4096x16384 rows).
                    gpu_us = interleaved_graph_us(graphs)
                    del graphs
                    row = {}
                    for impl in impls:
                        ms = call_ms[impl]
                        gpu_ms = gpu_us[impl] / 1e3 if impl in gpu_us else None
                        tflops = flops / ms / 1e9
                        graph_tflops = flops / gpu_ms / 1e9 if gpu_ms else None
                        results.add(impl, mode, case, ms, tflops=tflops, graph_ms=gpu_ms,
                                    graph_tflops=graph_tflops)
                        row[impl] = graph_tflops or float("nan")
                        print(f"{approximate:4} M={m} K={k} N={n} {mode:7} {impl:22} {ms:8.4f} ms "
                              f"{tflops:6.1f} TFLOP/s  graph {gpu_ms or float('nan'):8.4f} ms "
                              f"{graph_tflops or float('nan'):6.1f} TFLOP/s", flush=True)
                    others = [v for key, v in row.items() if key != "flash"]
                    table.append([approximate, m, k, n, mode, row["flash"], row["eager"], row["inductor"],
                                  row.get("inductor_max_autotune", "-"), row.get("addmm_activation", "-"),
                                  row["flash"] / row["inductor"], row["flash"] / max(others)])
                    results.write()  # a run cut short by the device's time limit still leaves its rows
                del x, w, b, grad
    path = results.write()
    print(f"\nwrote {path}\n")
    from flash_backend.ops.dense import forward_path_choices

    print("forward implementation measured fastest per problem (device, dtype, M bucket, K, N, bias, "
          "approximate, training):")
    for key, name in sorted(forward_path_choices().items(), key=str):
        print(f"  {key[2:]}: {name}")
    from flash_backend.ops.dense import cublaslt_algo_picks

    print("cuBLASLt algorithm picked per GEMM problem (candidate kept of those timed, median round us each):")
    for pick in cublaslt_algo_picks():
        print(f"  {pick}")
    print(markdown_table(
        ["GELU", "M", "K", "N", "mode", "flash", "eager", "inductor", "max-autotune", "addmm_act",
         "flash/inductor", "flash/best other"], table))
    print("\n(GPU time as TFLOP/s, CUDA-graph replay, bf16; '-' = not run)")


if __name__ == "__main__":
    main()
