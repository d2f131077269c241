"""Every cuBLASLt configuration of bench_dense's GEMM problems, timed on the GPU: the search behind csrc's
kExtraConfigs (csrc/dense_gelu.cpp). Per (M, K, N) and GEMM (forward GELU_AUX_BIAS and BIAS, dX, dW, dW with
BGRADB) it prints the fastest configurations, the heuristic's candidates ("H<i>") among them, and a SUMMARY
line against what the package runs today (our csrc op, or aten's mm for dX / dW).

    python bench/cublaslt_config_search.py [budget seconds per problem, default 20]

At the largest shape only the restricted space is searched (algorithm 66, stage id 35, three cluster shapes:
where every winner at the smaller shapes lay). Logs of the H200 runs:
bench/logs/cublaslt_config_search{,2}_h200.log.
"""

import os
import sys
import time

import torch

# cublasLtEpilogue_t values
DEFAULT, BIAS, GELU_AUX_BIAS, BGRADB = 1, 4, 164, 512
SHAPES = [(8192, 768, 3072), (16384, 768, 3072), (8192, 4096, 16384)]


def _build():
    from flash_backend import _cpp_build

    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cublaslt_config_search.cpp")
    _cpp_build.load_extension("cublaslt_config_search", [source], libraries=("cublasLt",),
                              header="cublasLt.h")


def search_shape(m, k, n, budget):
    """The search at one (M, K, N): row-major PyTorch tensors mapped onto cuBLASLt's column-major GEMMs as
    csrc/dense_gelu.cpp maps them."""
    from flash_backend.ops import dense

    def events_us(fn):  # the per-problem forward choice's timing: calls queued behind a sleep kernel
        return dense._time_ms(fn, reps=20) * 1e3

    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, g = torch.randn(m, k, **bf16), torch.randn(m, n, **bf16)
    w, b = torch.randn(n, k, **bf16) * k**-0.5, torch.randn(n, **bf16)
    out, pre = torch.empty(m, n, **bf16), torch.empty(m, n, **bf16)
    gx, gw, gb = torch.empty(m, k, **bf16), torch.empty(n, k, **bf16), torch.empty(n, **bf16)
    assert dense.cublaslt_ready(x)
    today = {
        "fwd_aux": events_us(lambda: torch.ops.flash.cublaslt_linear_gelu_tanh(x, w, b, True)),
        "fwd_bias": events_us(lambda: torch.ops.flash.cublaslt_linear(x, w, b)),
        "dX": events_us(lambda: g @ w),
        "dW": events_us(lambda: g.t() @ x),
        "dW_bgradb": events_us(lambda: torch.ops.flash.cublaslt_linear_wgrad_bgrad(g, x)),
    }
    # (A, B, D, bias, aux, transa, transb, m, n, k, lda, ldb, ldd, epilogue) of the column-major GEMM
    problems = {
        "fwd_aux": (w, x, out, b, pre, 1, 0, n, m, k, k, k, n, GELU_AUX_BIAS),
        "fwd_bias": (w, x, out, b, None, 1, 0, n, m, k, k, k, n, BIAS),
        "dX": (w, g, gx, None, None, 0, 0, k, m, n, k, n, k, DEFAULT),
        "dW": (x, g, gw, None, None, 0, 1, k, n, m, k, n, k, DEFAULT),
        "dW_bgradb": (x, g, gw, gb, None, 0, 1, k, n, m, k, n, k, BGRADB),
    }
    big = m * k * n > 1e11
    for name, args in problems.items():
        for restricted in (1,) if big else (1, 0):
            label = name + ("_restricted" if restricted else "_full")
            t0 = time.time()
            lines = torch.ops.ltsearch.search(*args, budget * (2.0 if big else 1.0), 12, restricted)
            print(f"== M={m} K={k} N={n} {label}: ours/torch today {today[name]:.2f} us "
                  f"(search {time.time() - t0:.1f} s)", flush=True)
            for line in lines:
                print("  " + line)
            best = float(lines[1].split("\t")[0])
            timed = [line.split("\t") for line in lines[1:]]
            h0 = next(float(us) for us, desc in timed if desc.startswith("H0 "))
            print(f"SUMMARY M={m} K={k} N={n} {label}: today {today[name]:.2f} heuristic0 {h0:.2f} "
                  f"best {best:.2f} ({today[name] / best:.3f}x today) search {time.time() - t0:.1f} s",
                  flush=True)


def main():
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    _build()
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(300):  # the clocks up before anything is timed
        warm @ warm
    for m, k, n in SHAPES:
        search_shape(m, k, n, budget)
    from flash_backend.ops import dense

    print("picks:", *dense.cublaslt_algo_picks(), sep="\n  ")


if __name__ == "__main__":
    main()
