"""Dropout + residual + LayerNorm / RMSNorm: flash (fused) vs eager vs Inductor on the same unfused module.

M=16384 rows, bf16, dropout 0.1 with a residual, weight (and bias for LayerNorm). The unfused module
returns both h = dropout(x) + residual and out = norm(h), as a pre-norm transformer block needs.

Bytes that must move, per element (e = 2 bytes for bf16; weight/bias are added but negligible):
  fwd      read x, residual; write out, h                      4e  =  8 B/elem
  bwd      read dout, dh, h; write dx, dresidual               5e  = 10 B/elem
  fwd+bwd  the sum                                             9e  = 18 B/elem
No dropout mask is counted: ours regenerates it from a seed. shared/ANCHORS.md counted a 1-byte mask in
fwd (9 B/elem), so its TB/s figures are 9/8 of what the same time gives in this count.

Implementations: `flash` calls our op from Python; `flash_compiled` is the unfused module under
torch.compile(backend="flash") — the product path, where the pass rewrites it and Inductor launches our
Triton kernels directly; `eager` and `inductor` run the unfused module.

Each implementation is timed twice: `ms` as called from Python (do_bench; includes launch overhead, which
is what an eager user sees), and `graph ms` with the step captured in a CUDA graph and replayed (the GPU
time alone, what CUDA graphs / reduce-overhead users see). Ratios "x Inductor" are Inductor's time / ours.

Usage: python bench/bench_layer_norm.py [--ns 4096,1024] [--impls flash,flash_compiled,eager,inductor]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import Results, bench_ms, env_info, markdown_table  # noqa: E402
from flash_backend.backend import flash_backend  # noqa: E402
from flash_backend.ops.add_dropout_norm import add_dropout_norm  # noqa: E402

M = 16384
NS = [4096, 1024, 768, 2048, 8192, 16384]
P = 0.1
EPS = 1e-5
DTYPE = torch.bfloat16


def unfused(x, residual, weight, bias, is_rms_norm: bool):
    h = F.dropout(x, P, training=True) + residual
    n = x.shape[-1]
    out = F.rms_norm(h, (n,), weight, EPS) if is_rms_norm else F.layer_norm(h, (n,), weight, bias, EPS)
    return out, h


def flash(x, residual, weight, bias, is_rms_norm: bool):
    return add_dropout_norm(x, residual, weight, bias, eps=EPS, dropout_p=P, is_rms_norm=is_rms_norm,
                            return_residual=True)


def make_case(n: int, is_rms_norm: bool, requires_grad: bool):
    """One setup for every implementation: inputs, output grads."""
    x = torch.randn(M, n, device="cuda", dtype=DTYPE, requires_grad=requires_grad)
    residual = torch.randn(M, n, device="cuda", dtype=DTYPE, requires_grad=requires_grad)
    weight = (1 + 0.1 * torch.randn(n, device="cuda", dtype=DTYPE)).requires_grad_(requires_grad)
    bias = None if is_rms_norm else (0.1 * torch.randn(n, device="cuda", dtype=DTYPE)).requires_grad_(
        requires_grad)
    grads = (torch.randn(M, n, device="cuda", dtype=DTYPE), torch.randn(M, n, device="cuda", dtype=DTYPE))
    return (x, residual, weight, bias), grads


def graph_ms(step) -> float | None:
    """GPU time alone: the step captured in a CUDA graph and replayed (no Python launch overhead)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return bench_ms(graph.replay)
    except Exception as e:  # report, keep benchmarking the rest
        print(f"  graph capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def copy_tbps() -> float:
    a = torch.empty(1 << 30, device="cuda", dtype=torch.uint8)
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    return 2 * a.numel() / ms / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--impls", default="flash,flash_compiled,eager,inductor")
    args = ap.parse_args()
    ns = [int(v) for v in args.ns.split(",")]
    impls = args.impls.split(",")
    torch.manual_seed(0)
    res = Results("layer_norm")
    copy = copy_tbps()
    res.add("copy", "copy", {"bytes": 1 << 30}, 0.0, tbps=copy)
    print(f"env {env_info()}  copy {copy:.2f} TB/s", flush=True)
    table = []
    for n in ns:
        for is_rms_norm in (False, True):
            norm = "rmsnorm" if is_rms_norm else "layernorm"
            for mode in ("fwd", "fwd+bwd"):
                train = mode == "fwd+bwd"
                inputs, grads = make_case(n, is_rms_norm, train)
                params = [t for t in inputs if t is not None]
                elem_bytes = (9 if train else 4) * DTYPE.itemsize
                nbytes = elem_bytes * M * n + sum(t.numel() * t.element_size() for t in params[2:])
                ms_by_impl = {}
                for impl in impls:
                    if impl == "flash":
                        fn = flash
                    elif impl == "flash_compiled":
                        fn = torch.compile(unfused, backend=flash_backend, dynamic=False)
                    elif impl == "eager":
                        fn = unfused
                    else:
                        fn = torch.compile(unfused, dynamic=False)

                    def step(fn=fn, inputs=inputs, params=params, grads=grads, rms=is_rms_norm, train=train):
                        outs = fn(*inputs, rms)
                        if train:
                            torch.autograd.grad(outs, params, grads)

                    with contextlib.nullcontext() if train else torch.no_grad():
                        t0 = time.time()
                        step()  # compile / warm
                        compile_s = time.time() - t0
                        ms = bench_ms(step)
                        gms = graph_ms(step)
                    ms_by_impl[impl] = (ms, gms)
                    case = {"M": M, "N": n, "dtype": "bf16", "dropout_p": P, "norm": norm}
                    res.add(impl, mode, case, ms, tbps=nbytes / ms / 1e9, compile_s=round(compile_s, 1),
                            graph_ms=gms and round(gms, 5), graph_tbps=gms and round(nbytes / gms / 1e9, 3))
                    res.write()
                    print(f"N={n} {norm} {mode} {impl}: {ms:.4f} ms {nbytes / ms / 1e9:.2f} TB/s; graph "
                          f"{gms or float('nan'):.4f} ms", flush=True)
                    torch._dynamo.reset()
                nan = float("nan")
                ind, ind_g = ms_by_impl.get("inductor", (None, None))
                for impl, (ms, gms) in ms_by_impl.items():
                    table.append([n, norm, mode, impl, ms, nbytes / ms / 1e9, ind / ms if ind else nan,
                                  gms or nan, nbytes / gms / 1e9 if gms else nan,
                                  nbytes / gms / 1e9 / copy if gms else nan,
                                  ind_g / gms if ind_g and gms else nan])
                del inputs, grads, params
    res.write()
    print(markdown_table(["N", "norm", "mode", "impl", "ms", "TB/s", "x Inductor", "graph ms", "graph TB/s",
                          "graph of copy", "graph x Inductor"], table))


if __name__ == "__main__":
    main()
