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
time alone, what CUDA graphs / reduce-overhead users see): the implementations of a case replayed in
interleaved rounds, L2 cleared before each replay as do_bench does. Ratios "x Inductor" are Inductor's
time / ours.

Usage: python bench/bench_layer_norm.py [--ns 4096,1024] [--impls flash,flash_compiled,eager,inductor]
       python bench/bench_layer_norm.py --sweep-bwd [--ns 4096] [--sweep-seconds 220]

--sweep-bwd times the backward launcher alone (CUDA-graph replay, 10 B/elem) under candidate launch shapes
(ops/add_dropout_norm.py: BwdConfig, the shipped one first) for N in SWEEP_NS, LayerNorm and RMSNorm; one
`SWEEP bwd` line per candidate (with its grads' largest difference from the shipped shape's, relative to
the largest grad), then `BEST bwd` per (N, norm) and a suggested _BWD_CONFIGS table. The time budget is
shared evenly by the (N, norm) cases still to run; a case out of time skips its remaining candidates. The
candidates of a case are timed together, in interleaved rounds, after all of them are compiled.
Each line prints `async_copies`: the row loads Triton's pipeliner turned into asynchronous copies.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flash_backend.ops.add_dropout_norm as adn  # noqa: E402
from bench._common import (  # noqa: E402
    Results,
    bench_ms,
    capture_graph_or_none,
    env_info,
    interleaved_graph_us,
    markdown_table,
    max_rel_diff,
)
from flash_backend.backend import flash_backend  # noqa: E402
from flash_backend.ops.add_dropout_norm import BwdConfig, add_dropout_norm  # noqa: E402

M = 16384
NS = [4096, 1024, 768, 2048, 8192, 16384]
SWEEP_NS = [768, 1024, 2048, 4096, 8192, 16384]
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


def copy_tbps() -> float:
    a = torch.empty(1 << 30, device="cuda", dtype=torch.uint8)
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    return 2 * a.numel() / ms / 1e9


# ----------------------------------------------------------------------------------------------------------
# --sweep-bwd
# ----------------------------------------------------------------------------------------------------------


def bwd_candidates(n: int, is_rms_norm: bool) -> list[BwdConfig]:
    """The shipped shape first, then the rest in the order they are most likely to win (a case that runs out
    of time drops the tail). BwdConfig(elems_per_thread, warps_per_sm, rows_per_iter, max_fused). Tiles of
    2+ rows keep elems_per_thread * 2 bytes >= 16: narrower rows per thread than a 16-byte load make Triton
    convert the tile between layouts through shared memory."""
    shipped = adn.bwd_config(n, is_rms_norm)
    cands = [
        shipped,
        # The one-row loop pipelined by Triton (row loads as asynchronous copies to shared memory, stages - 1
        # rows ahead, no registers held for them)
        BwdConfig(8, 16, pipeline_stages=3),
        BwdConfig(8, 16, pipeline_stages=2),
        BwdConfig(8, 16, pipeline_stages=4),
        BwdConfig(16, 16, pipeline_stages=3),
        # more rows in flight: 4-5 stages of 8-warp programs (two per SM where shared memory allows)
        BwdConfig(16, 16, pipeline_stages=4),
        BwdConfig(16, 8, pipeline_stages=4),
        BwdConfig(16, 8, pipeline_stages=5),
        BwdConfig(8, 16, pipeline_stages=5),
        BwdConfig(32, 8, pipeline_stages=4),  # 32 elements a thread: 4-warp programs at N=4096
        BwdConfig(32, 4, pipeline_stages=4),
        BwdConfig(32, 8, pipeline_stages=3),
        BwdConfig(8, 32, pipeline_stages=3),
        BwdConfig(16, 8, pipeline_stages=3),
        BwdConfig(4, 32, pipeline_stages=3),
        BwdConfig(16, 32, pipeline_stages=2),
        # The software-pipelined one-row loop (the next row's loads before this row's reductions): the
        # registers of a second row, so fewer or narrower programs.
        BwdConfig(8, 16, prefetch=True),
        BwdConfig(16, 8, prefetch=True),
        BwdConfig(16, 16, prefetch=True),
        BwdConfig(8, 32, prefetch=True),
        BwdConfig(8, 16, 2),  # 2-row tile; ~120 registers at 16 warps: one program per SM at N=4096
        BwdConfig(16, 32, 1),  # RMSNorm's best in the earlier sweep (-12% at 4096, -20% at 8192)
        BwdConfig(16, 16, 1),  # LayerNorm's best in the earlier sweep (-5% at 4096)
        BwdConfig(8, 32, 2),
        BwdConfig(16, 16, 2),
        BwdConfig(8, 32, 1),
        BwdConfig(4, 32, 1),
        BwdConfig(8, 16, 4),
        # The row re-read after its reductions (L1/L2) instead of its fp32 terms held through them: it won
        # only where rows spill without it (LayerNorm at 16384, below), 0.80-0.99x elsewhere in session 18
        shipped._replace(reload_rows=True),
        BwdConfig(16, 16, pipeline_stages=3, reload_rows=True),
        BwdConfig(8, 16, prefetch=True, reload_rows=True),
    ]
    if n > 8192:  # whole rows in registers past the shipped 8192 (RMSNorm -32% at 16384 earlier)
        cands[1:1] = [BwdConfig(32, 16, 1, 16384, reload_rows=True),
                      BwdConfig(16, 32, 1, 16384, reload_rows=True),
                      BwdConfig(16, 16, 1, 16384, reload_rows=True),
                      BwdConfig(16, 32, 1, 16384, pipeline_stages=2, reload_rows=True),
                      BwdConfig(16, 32, 1, 16384), BwdConfig(32, 16, 1, 16384), BwdConfig(16, 32, 2, 16384)]
    return cands


def _effective_launch(n: int, cfg: BwdConfig) -> tuple:
    """What the launcher actually runs for cfg at (M, n): candidates that differ only in ignored fields (rows
    per iteration of chunked rows, warps per SM past the cap) time the same kernel and are skipped."""
    block_n, num_chunks = adn._block_and_chunks(n, cfg.max_fused)
    num_warps = adn._num_warps(block_n, cfg.elems_per_thread, 32)
    programs = adn._num_programs(torch.device("cuda"), M, num_warps, cfg.warps_per_sm)
    rows_per_iter = cfg.rows_per_iter if num_chunks == 1 else 1
    prefetch, stages, reload = adn.one_row_loop_flags(cfg, rows_per_iter, num_chunks)
    return block_n, num_chunks, num_warps, programs, rows_per_iter, cfg.num_stages, prefetch, stages, reload


class _Capture:
    """`launch=` wrapper keeping the compiled kernel of the first launch (for its registers and spills)."""

    compiled = None

    def __call__(self, kernel):
        capture = self

        class _Grid:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    compiled = kernel[grid](*args, **kwargs)
                    if capture.compiled is None:  # the backward kernel, not the partial sums' after it
                        capture.compiled = compiled
                    return compiled

                return run

        return _Grid()


def _async_copies(compiled) -> int | str:
    """Loads Triton's pipeliner turned into asynchronous copies (0: the loop's loads stay synchronous)."""
    try:
        return compiled.asm["ttgir"].count("async_copy_global_to_local")
    except Exception:  # noqa: BLE001 - a diagnostic only
        return "?"


def _sweep_case(n: int, rms: bool, case_end: float, copy: float) -> list[tuple[BwdConfig, float]]:
    """Compile, check and capture each candidate of (n, rms) until case_end, then time all captured ones in
    interleaved rounds (one after the other, the same kernel measured up to 5 % apart as the chip's clock
    drifted); returns (cfg, us) of those whose grads match, the shipped shape first."""
    norm = "rmsnorm" if rms else "layernorm"
    (x, residual, weight, bias), _ = make_case(n, rms, requires_grad=False)
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device="cuda")
    fwd_args = (x, residual, weight, bias, seed, EPS, P, rms, False, True)
    _, h, mean, rstd = adn.add_dropout_norm_fwd_launch(*fwd_args)
    dy, dres = torch.randn_like(x), torch.randn_like(h)
    del x, residual, fwd_args
    bwd_args = (dy, dres, h, weight, bias, mean, rstd, seed, P, rms, True, DTYPE, DTYPE)
    nbytes = 5 * DTYPE.itemsize * M * n  # read dy, dh, h; write dx, dresidual
    graphs, notes, seen, ref = {}, {}, set(), None
    for cfg in bwd_candidates(n, rms):
        key = _effective_launch(n, cfg)
        if key in seen:
            continue
        seen.add(key)
        if ref is not None and time.time() > case_end:
            print(f"SWEEP bwd N={n} norm={norm}: out of time, remaining candidates skipped", flush=True)
            break
        step = functools.partial(adn.add_dropout_norm_bwd_launch, *bwd_args, config=cfg)
        try:
            capture = _Capture()
            got = step(launch=capture)  # compiles
            err = 0.0 if ref is None else max_rel_diff(got, ref)
            ref = got if ref is None else ref
            graph = capture_graph_or_none(step)
        except Exception as e:  # report, keep sweeping
            print(f"SWEEP bwd N={n} norm={norm} cfg={tuple(cfg)} FAIL {type(e).__name__}: {str(e)[:200]}",
                  flush=True)
            continue
        if graph is None:
            continue
        k = capture.compiled
        _, chunks, warps, programs, rows_per_iter, *_ = key
        graphs[cfg] = graph
        notes[cfg] = (f"warps={warps} programs={programs} chunks={chunks} rows_per_iter={rows_per_iter} "
                      f"regs={getattr(k, 'n_regs', '?')} spills={getattr(k, 'n_spills', '?')} "
                      f"async_copies={_async_copies(k)}", err)
    rows = []
    for cfg, us in interleaved_graph_us(graphs, rounds=5, reps=10).items():
        note, err = notes[cfg]
        bad = "  MISMATCH" if err > 2e-2 else ""
        print(f"SWEEP bwd N={n} norm={norm} cfg={tuple(cfg)} us={us:.1f} TB/s={nbytes / us / 1e6:.2f} "
              f"of_copy={nbytes / us / 1e6 / copy:.2f} {note} err={err:.1e}{bad}", flush=True)
        if not bad:
            rows.append((cfg, us))
    return rows


def run_sweep_bwd(args, ns):
    copy = copy_tbps()
    print(f"env {env_info()}  copy {copy:.2f} TB/s", flush=True)
    cases = [(n, rms) for n in ns for rms in (False, True)]
    t_end = time.time() + args.sweep_seconds
    results = {}  # (n, rms) -> [(cfg, us)], the shipped shape first
    for i, (n, rms) in enumerate(cases):
        case_end = time.time() + max(0.0, t_end - time.time()) / (len(cases) - i)
        results[(n, rms)] = _sweep_case(n, rms, case_end, copy)
        torch.cuda.empty_cache()
    _print_sweep_summary(results, nbytes_per_n={n: 5 * DTYPE.itemsize * M * n for n in ns})


def _cfg_str(cfg: BwdConfig) -> str:
    """BwdConfig(...) as it would be written in _BWD_CONFIGS: positional fields, defaults left out."""
    default = BwdConfig(cfg.elems_per_thread, cfg.warps_per_sm)
    fields = [str(cfg.elems_per_thread), str(cfg.warps_per_sm)]
    fields += [f"{name}={value}" for name, value in cfg._asdict().items()
               if name not in ("elems_per_thread", "warps_per_sm") and value != getattr(default, name)]
    return f"BwdConfig({', '.join(fields)})"


def _print_sweep_summary(results, nbytes_per_n):
    for (n, rms), rows in results.items():
        if not rows:
            continue
        cfg, us = min(rows, key=lambda r: r[1])
        shipped_us = rows[0][1]
        print(f"BEST bwd N={n} norm={'rmsnorm' if rms else 'layernorm'} cfg={_cfg_str(cfg)} us={us:.1f} "
              f"TB/s={nbytes_per_n[n] / us / 1e6:.2f} (shipped {shipped_us:.1f} us: {shipped_us / us:.2f}x)")
    # One shape per (bucket, norm): the N of a bucket (768 and 1024 share one) are weighted equally, by time
    # relative to each N's best; only shapes timed at every N of the bucket compete.
    print("suggested _BWD_CONFIGS entries (buckets not swept keep theirs):")
    table_buckets = sorted({bucket for bucket, _ in adn._BWD_CONFIGS})
    buckets = {}
    for (n, rms), rows in results.items():
        if rows:
            bucket = min(b for b in table_buckets if b >= triton.next_power_of_2(n))
            buckets.setdefault((bucket, rms), []).append(rows)
    for (bucket, rms), per_n in sorted(buckets.items()):
        common = set.intersection(*({cfg for cfg, _ in rows} for rows in per_n))
        if not common:
            continue

        def cost(cfg, per_n=per_n):
            return math.fsum(dict(rows)[cfg] / min(us for _, us in rows) for rows in per_n)

        best = min(common, key=cost)
        print(f"    ({bucket}, {rms}): {_cfg_str(best)},  # {cost(best) / len(per_n):.3f}x of the best per N")


def main():
    global P  # --dropout-p sets it for --sweep-bwd
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default=None, help=f"default {NS}; with --sweep-bwd {SWEEP_NS}")
    ap.add_argument("--impls", default="flash,flash_compiled,eager,inductor")
    ap.add_argument("--sweep-bwd", action="store_true", help="time backward launch shapes (see docstring)")
    ap.add_argument("--sweep-seconds", type=float, default=220.0, help="time budget of --sweep-bwd")
    ap.add_argument("--dropout-p", type=float, default=P, help="--sweep-bwd only: the dropout probability")
    args = ap.parse_args()
    P = args.dropout_p if args.sweep_bwd else P
    if args.sweep_bwd:
        torch.manual_seed(0)
        run_sweep_bwd(args, [int(v) for v in args.ns.split(",")] if args.ns else SWEEP_NS)
        return
    ns = [int(v) for v in args.ns.split(",")] if args.ns else NS
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
                ms_by_impl, graphs, compile_s = {}, {}, {}
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
                        compile_s[impl] = time.time() - t0
                        ms_by_impl[impl] = bench_ms(step)
                        graph = capture_graph_or_none(step)
                    if graph is not None:
                        graphs[impl] = graph
                    torch._dynamo.reset()
                # GPU time of all implementations in interleaved rounds, so that a clock drift during the
                # case lands on every implementation alike; L2 cleared before each replay, as do_bench does.
                gpu_us = interleaved_graph_us(graphs, rounds=5, reps=20, clear_l2=True)
                del graphs
                case = {"M": M, "N": n, "dtype": "bf16", "dropout_p": P, "norm": norm}
                for impl, ms in ms_by_impl.items():
                    gms = gpu_us[impl] / 1e3 if impl in gpu_us else None
                    ms_by_impl[impl] = (ms, gms)
                    res.add(impl, mode, case, ms, tbps=nbytes / ms / 1e9, compile_s=round(compile_s[impl], 1),
                            graph_ms=gms and round(gms, 5), graph_tbps=gms and round(nbytes / gms / 1e9, 3))
                    print(f"N={n} {norm} {mode} {impl}: {ms:.4f} ms {nbytes / ms / 1e9:.2f} TB/s; graph "
                          f"{gms or float('nan'):.4f} ms", flush=True)
                res.write()  # a run cut short by the device's time limit still leaves its rows
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
