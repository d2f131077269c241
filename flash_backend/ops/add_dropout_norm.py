"""Fused dropout + residual add + LayerNorm / RMSNorm: `torch.ops.flash.add_dropout_norm_{fwd,bwd}`.

    h   = dropout(x, p) + residual          (both optional; h is rounded to residual_out's dtype)
    out = LayerNorm(h) * weight + bias      or   RMSNorm(h) * weight

One pass over memory in each direction. Trade-offs:

- The dropout mask is never stored: it is regenerated in backward from an int64 seed *tensor* with
  Philox-4x32-7 (`tl.randint4x`, one call per eight columns: column j of a row takes the 16-bit half
  j % 2 of word (j % 8) // 2 of call row * cdiv(N, 8) + j // 8), so no byte mask moves and no host sync
  happens (CUDA-graph safe). An element is kept when its half is >= round(p * 65536), and kept values are
  scaled by the inverse of that exact keep probability (ops/_philox.py, as the attention op's dropout).
  The CPU reference runs the same Philox in plain torch, so CPU, GPU and the interpreter compute the same
  function bit for bit in the mask.
- h is written whenever it differs from x (residual, dropout or dtype change) and backward reads it back:
  one read of h is cheaper than re-reading x and residual. When h is x, nothing is written and backward
  reads x.
- The norm sees h *after* rounding to residual_out's dtype, as eager `F.layer_norm(dropout(x) + res)` does.
- A row of up to `_MAX_FUSED_N_FWD` / `_MAX_FUSED_N_BWD` columns lives in registers (one pass); wider
  rows (up to 65536) loop over chunks, at the cost of re-reading h (and dy in backward) once. Backward
  keeps each program's partial dW/dB in registers over several rows, like flash-attn's layer_norm.py, and
  sums the per-program partials afterwards. The kernels live in flash_backend/kernels/.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch.library import triton_op

from flash_backend._device import sm_count
from flash_backend._host_math import cdiv, next_power_of_2
from flash_backend._traced_launch import traced_launch
from flash_backend.kernels.add_dropout_norm_kernels import (
    _add_dropout_norm_bwd_kernel,
    _add_dropout_norm_fwd_kernel,
)
from flash_backend.kernels.partial_sums import sum_partials
from flash_backend.ops._eager import direct_call_ok, needs_autograd, plain_launch
from flash_backend.ops._forward_ad import refuse_forward_ad
from flash_backend.ops._outputs import as_output
from flash_backend.ops._philox import (
    DROPOUT_PHILOX_ROUNDS,
    HALF,
    dropout_scale,
    dropout_threshold,
    philox_4x32,
)

MAX_N = 65536
_MIN_BLOCK_N = 16
# Forward launch shape: the one that passed the H200 tests and produced bench/results/layer_norm.json.
_MAX_FUSED_N_FWD = 16384
_FWD_ELEMS_PER_THREAD = 16  # elements of a row per thread
_MAX_FUSED_N_BWD = 8192  # widest backward row in registers unless a _BWD_CONFIGS entry says otherwise


class BwdConfig(NamedTuple):
    """Launch shape of the backward kernel (add_dropout_norm_bwd_launch's `config`; a plain tuple works)."""

    elems_per_thread: int  # elements of a row per thread: num_warps = BLOCK_N / (32 * this), at most 32
    warps_per_sm: int  # warps per SM the persistent programs are sized to fill (sets the program count)
    rows_per_iter: int = 1  # rows per loop iteration, a power of two; a thread holds rows * elems values
    max_fused: int = _MAX_FUSED_N_BWD  # widest row kept in registers; wider rows loop over such chunks
    num_stages: int | None = None  # None: Triton's default
    prefetch: bool = False  # one-row loop: issue the next row's loads before this row's reductions
    pipeline_stages: int = 0  # one-row loop: > 0 lets Triton pipeline the row loads through shared memory
    reload_rows: bool = False  # one-row loops: re-read h and dy after the row's reductions (L1/L2 hits)


_BWD_SHIPPED = BwdConfig(8, 32)
# Backward launch shapes per (largest next_power_of_2(N) of the bucket, is_rms_norm), first bucket that
# holds N wins: the best of `bench_layer_norm.py --sweep-bwd` on the H200 (M=16384, bf16, dropout +
# residual). Buckets up to 8192: bench/logs/sweep_bwd_prefetch_h200.log (the software-pipelined one-row
# loop wins everywhere but LayerNorm at N <= 1024: 1.04-1.06x at 2048-4096, 1.24-1.28x at 8192, where the
# earlier shapes left HBM idle during each row's reductions). 16384: bench/logs/sweep_bwd_h200.log (8689faa;
# whole rows in registers, RMSNorm 1.49x). Rows wider than 16384 keep the first shape, (8, 32).
_BWD_CONFIGS: dict[tuple[int, bool], BwdConfig] = {
    (1024, False): BwdConfig(16, 16),
    (1024, True): BwdConfig(16, 16, prefetch=True),
    (2048, False): BwdConfig(8, 16, prefetch=True),
    (2048, True): BwdConfig(16, 16, prefetch=True),
    (4096, False): BwdConfig(8, 16, prefetch=True),
    (4096, True): BwdConfig(8, 16, prefetch=True),
    (8192, False): BwdConfig(16, 8, prefetch=True),
    (8192, True): BwdConfig(16, 8, prefetch=True),  # = (8, 16, prefetch) within 0.1%, and no 64-register cap
    # LayerNorm's 16384-column rows spill (36 at 128 registers): re-reading the row after its reductions
    # (reload_rows) spills 16 and runs 1.07x faster (bench/logs/sweep_bwd_reload_interleaved_h200.log).
    (16384, False): BwdConfig(32, 16, max_fused=16384, reload_rows=True),
    (16384, True): BwdConfig(16, 32, max_fused=16384),
    (MAX_N, False): _BWD_SHIPPED,
    (MAX_N, True): _BWD_SHIPPED,
}
# Where the loop Triton pipelines (row loads as asynchronous copies to shared memory, two rows ahead) beat the
# entries above, for N a multiple of 16 (otherwise Triton cannot prove 4-byte aligned row loads and does not
# pipeline them). bench/logs/sweep_bwd_pipelined_h200.log (53bbf3f), GPU time against the entries above:
# LayerNorm 1.05x at N=768, 1.07x at 1024, 1.03x at 4096; RMSNorm 1.03x at 4096. Elsewhere the
# hand-prefetched loop stayed ahead. Later sweeps timed every shape in interleaved rounds (see the entries).
_PIPELINE_SMEM_BYTES = 160 * 1024  # the most the pipelined loop's stages may hold (bf16 N=8192: 144 KB)
_BWD_PIPELINED: dict[tuple[int, bool], BwdConfig] = {
    (1024, False): BwdConfig(16, 16, pipeline_stages=3),
    # RMSNorm at 768-1024: one 8-warp program per SM in 4 stages, 1.05x at 768 and 1.02x at 1024 the
    # prefetched loop (bench/logs/sweep_bwd_stages2_h200.log)
    (1024, True): BwdConfig(16, 8, pipeline_stages=4),
    # LayerNorm at 2048: 1.12x the prefetched loop when all shapes were timed in interleaved rounds
    # (bench/logs/sweep_bwd_2048_8192_interleaved_h200.log; the earlier sweep timed them one after another)
    (2048, False): BwdConfig(16, 16, pipeline_stages=3),
    # LayerNorm at 4096: one 8-warp program per SM in 4 stages, 1.03x / 1.02x two 3-stage programs in two
    # sweeps (bench/logs/sweep_bwd_stages{,2}_h200.log)
    (4096, False): BwdConfig(16, 8, pipeline_stages=4),
    # RMSNorm at 4096: one 16-warp program per SM, 4 stages (96 KB of rows in flight): 1.05x the 8-warp,
    # 3-stage shape in two sweeps (bench/logs/sweep_bwd_reload_{sequential,interleaved}_h200.log)
    (4096, True): BwdConfig(8, 16, pipeline_stages=4),
    # (8192, True) pipelined (16, 16, 3 stages) measured 1.03x *slower* than the prefetched loop in the
    # interleaved sweep, so RMSNorm at 8192 keeps _BWD_CONFIGS' shape.
}
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------
# Dropout mask (shared by the reference and the kernels)
# ----------------------------------------------------------------------------------------------------------


_COLUMNS_PER_CALL = 8  # one Philox call = 4 words = 8 16-bit halves = 8 columns


def dropout_keep_mask(seed: torch.Tensor, rows: int, n: int, dropout_p: float) -> torch.Tensor:
    """The (rows, n) bool keep-mask the kernels draw for `seed` (an int64 tensor of one element)."""
    device = seed.device
    calls = cdiv(n, _COLUMNS_PER_CALL)
    counter = torch.arange(rows, device=device, dtype=torch.int64)[:, None] * calls + torch.arange(
        calls, device=device, dtype=torch.int64
    )
    # tl.randint4x splits its int64 counter into the first two counter words.
    words = torch.stack(philox_4x32(seed, counter & 0xFFFFFFFF, counter >> 32, DROPOUT_PHILOX_ROUNDS), -1)
    halves = torch.stack([words & (HALF - 1), words >> 16], -1)  # (rows, calls, word, half)
    return halves.reshape(rows, calls * _COLUMNS_PER_CALL)[:, :n] >= dropout_threshold(dropout_p)


# ----------------------------------------------------------------------------------------------------------
# Reference (the CPU implementation)
# ----------------------------------------------------------------------------------------------------------


def _dtypes(x, residual, residual_in_fp32):
    h_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    residual_dtype = torch.float32 if residual_in_fp32 else h_dtype
    return h_dtype, residual_dtype


def _stores_residual_out(x, residual, dropout_p, residual_in_fp32, return_residual) -> bool:
    _, residual_dtype = _dtypes(x, residual, residual_in_fp32)
    return return_residual or residual is not None or dropout_p > 0.0 or residual_dtype != x.dtype


def _allocate_fwd(x, residual, weight, eps, dropout_p, is_rms_norm, residual_in_fp32, return_residual):
    """The forward's outputs, exactly as every implementation (CUDA, CPU, fake) allocates them."""
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    out_dtype, residual_dtype = _dtypes(x, residual, residual_in_fp32)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if _stores_residual_out(x, residual, dropout_p, residual_in_fp32, return_residual):
        residual_out = torch.empty(x.shape, dtype=residual_dtype, device=x.device)
    else:
        residual_out = torch.empty((0,), dtype=residual_dtype, device=x.device)
    mean = torch.empty((0 if is_rms_norm else m,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    return out, residual_out, mean, rstd


def add_dropout_norm_ref(x, residual=None, weight=None, bias=None, seed=None, eps=1e-5, dropout_p=0.0,
                         is_rms_norm=False, residual_in_fp32=False, upcast=False):
    """Plain-torch (out, h, mean, rstd) in fp32 math; `upcast=True` computes in fp64 and skips the rounding
    of h, for use as the accuracy reference in tests."""
    n = x.shape[-1]
    compute = torch.float64 if upcast else torch.float32
    _, residual_dtype = _dtypes(x, residual, residual_in_fp32)
    h = x.reshape(-1, n).to(compute)
    if dropout_p > 0.0:
        keep = dropout_keep_mask(seed, h.shape[0], n, dropout_p)
        h = torch.where(keep, h * dropout_scale(dropout_p), 0.0)
    if residual is not None:
        h = h + residual.reshape(-1, n).to(compute)
    if not upcast:
        h = h.to(residual_dtype).to(compute)
    if is_rms_norm:
        mean = None
        rstd = torch.rsqrt(h.square().mean(-1) + eps)
        y = h * rstd[:, None]
    else:
        mean = h.mean(-1)
        rstd = torch.rsqrt((h - mean[:, None]).square().mean(-1) + eps)
        y = (h - mean[:, None]) * rstd[:, None]
    if weight is not None:
        y = y * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.reshape(x.shape), h.reshape(x.shape), mean, rstd


def _fwd_cpu(x, residual, weight, bias, seed, eps, dropout_p, is_rms_norm, residual_in_fp32, return_residual):
    out, residual_out, mean, rstd = _allocate_fwd(
        x, residual, weight, eps, dropout_p, is_rms_norm, residual_in_fp32, return_residual
    )
    y, h, mean_ref, rstd_ref = add_dropout_norm_ref(
        x, residual, weight, bias, seed, eps, dropout_p, is_rms_norm, residual_in_fp32
    )
    # results returned, not copied into the buffers: ops/_outputs.py says why
    if residual_out.numel():
        # with neither residual nor dropout h may be x itself, which an output may not alias
        residual_out = as_output(h.clone() if residual is None and dropout_p == 0.0 else h, residual_out)
    if mean.numel():
        mean = as_output(mean_ref, mean)
    return as_output(y, out), residual_out, mean, as_output(rstd_ref, rstd)


def _bwd_cpu(dy, dresidual_out, h, weight, bias, mean, rstd, seed, dropout_p, is_rms_norm, has_residual,
             x_dtype, residual_dtype):
    dx, dresidual, dweight, dbias = _allocate_bwd(dy, h, weight, bias, has_residual, x_dtype, residual_dtype)
    n = h.shape[-1]
    hf = h.reshape(-1, n).float()
    dyf = dy.reshape(-1, n).float()
    xhat = hf * rstd[:, None] if is_rms_norm else (hf - mean[:, None]) * rstd[:, None]
    wdy = dyf * weight.float() if weight is not None else dyf
    c1 = (xhat * wdy).mean(-1, keepdim=True)
    if is_rms_norm:
        dh = (wdy - xhat * c1) * rstd[:, None]
    else:
        dh = (wdy - xhat * c1 - wdy.mean(-1, keepdim=True)) * rstd[:, None]
    if dresidual_out is not None:
        dh = dh + dresidual_out.reshape(-1, n).float()
    # results returned, not copied into the buffers: ops/_outputs.py says why
    if has_residual:
        dresidual = as_output(dh.reshape(dresidual.shape), dresidual)
    if dropout_p > 0.0:
        keep = dropout_keep_mask(seed, hf.shape[0], n, dropout_p)
        dh = torch.where(keep, dh * dropout_scale(dropout_p), 0.0)
    elif has_residual:
        dh = dh.clone()  # dx would be dresidual itself: an op's outputs may not alias each other
    dx = as_output(dh.reshape(dx.shape), dx)
    if weight is not None:
        dweight = as_output((dyf * xhat).sum(0), dweight)
    if bias is not None:
        dbias = as_output(dyf.sum(0), dbias)
    return dx, dresidual, dweight, dbias


def _allocate_bwd(dy, h, weight, bias, has_residual, x_dtype, residual_dtype):
    dx = torch.empty(h.shape, dtype=x_dtype, device=h.device)
    empty = (0,)
    dresidual = torch.empty(h.shape if has_residual else empty, dtype=residual_dtype, device=h.device)
    dweight = torch.empty(weight.shape if weight is not None else empty,
                          dtype=weight.dtype if weight is not None else torch.float32, device=h.device)
    dbias = torch.empty(bias.shape if bias is not None else empty,
                        dtype=bias.dtype if bias is not None else torch.float32, device=h.device)
    return dx, dresidual, dweight, dbias


# ----------------------------------------------------------------------------------------------------------
# Launchers (also called directly by the interpreter tests, on CPU tensors)
# ----------------------------------------------------------------------------------------------------------


def _block_and_chunks(n: int, max_fused: int) -> tuple[int, int]:
    block_n = max(next_power_of_2(n), _MIN_BLOCK_N)
    if block_n <= max_fused:
        return block_n, 1
    return max_fused, cdiv(n, max_fused)


def _num_warps(block_n: int, elems_per_thread: int, max_warps: int) -> int:
    return min(max(block_n // (32 * elems_per_thread), 1), max_warps)


def _rows(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """A (M, N) view with contiguous columns (copies only when the last dim is strided)."""
    if t is None:
        return None
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def add_dropout_norm_fwd_launch(x, residual, weight, bias, seed, eps, dropout_p, is_rms_norm,
                                residual_in_fp32, return_residual, *, launch=plain_launch):
    """Allocate the outputs and run the forward kernel through `launch` (traced_launch in the op)."""
    out, residual_out, mean, rstd = _allocate_fwd(
        x, residual, weight, eps, dropout_p, is_rms_norm, residual_in_fp32, return_residual
    )
    n = x.shape[-1]
    m = rstd.shape[0]
    if m == 0:
        return out, residual_out, mean, rstd
    x2, res2 = _rows(x, n), _rows(residual, n)
    out2 = out.view(-1, n)
    store_h = residual_out.numel() > 0
    res_out2 = residual_out.view(-1, n) if store_h else out2
    block_n, num_chunks = _block_and_chunks(n, _MAX_FUSED_N_FWD)
    has_dropout = dropout_p > 0.0
    kernel = launch(_add_dropout_norm_fwd_kernel)
    kernel[(m,)](
        x2, res2 if res2 is not None else x2, weight if weight is not None else x2,
        bias if bias is not None else x2, seed if has_dropout else rstd,
        out2, res_out2, mean if not is_rms_norm else rstd, rstd,
        x2.stride(0), res2.stride(0) if res2 is not None else 0, out2.stride(0), res_out2.stride(0),
        n, cdiv(n, _COLUMNS_PER_CALL), eps, dropout_threshold(dropout_p), dropout_scale(dropout_p),
        BLOCK_N=block_n, NUM_CHUNKS=num_chunks, IS_RMS_NORM=is_rms_norm, HAS_RESIDUAL=residual is not None,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, HAS_DROPOUT=has_dropout,
        STORE_RESIDUAL_OUT=store_h, num_warps=_num_warps(block_n, _FWD_ELEMS_PER_THREAD, 16),
    )
    return out, residual_out, mean, rstd


def _num_programs(device: torch.device, m: int, num_warps: int, warps_per_sm: int) -> int:
    if device.type == "cuda":
        sms = sm_count(device)
        return min(m, sms * max(1, warps_per_sm // num_warps))
    return min(m, 4)


def bwd_config(n: int, is_rms_norm: bool, row_bytes: int = 6) -> BwdConfig:
    """The shipped backward launch shape for rows of n columns; row_bytes: bytes per column of the rows the
    loop loads (h, dy, d(residual_out); 6 for bf16 with a residual stream)."""
    block_n = next_power_of_2(n)
    bucket = min(b for b, rms in _BWD_CONFIGS if rms == is_rms_norm and b >= block_n)
    pipelined = _BWD_PIPELINED.get((bucket, is_rms_norm))
    # Each pipeline stage holds a row of every loaded tensor in shared memory (228 KB an SM on the H200, with
    # the reductions' scratch): fp32 rows of 8192 columns in 3 stages need ~290 KB, so they keep the table's.
    if pipelined and n % 16 == 0 and pipelined.pipeline_stages * block_n * row_bytes <= _PIPELINE_SMEM_BYTES:
        return pipelined
    return _BWD_CONFIGS[(bucket, is_rms_norm)]


def one_row_loop_flags(cfg: BwdConfig, rows_per_iter: int, num_chunks: int) -> tuple[bool, int, bool]:
    """(PREFETCH, PIPELINE_STAGES, RELOAD_ROWS) as the backward kernel gets them for cfg: all three shape the
    one-row loop (one row an iteration, in one chunk) and are off for tiles and chunked rows; a pipelined
    loop ignores prefetch."""
    one_row = rows_per_iter == 1 and num_chunks == 1
    stages = cfg.pipeline_stages if one_row else 0
    return bool(cfg.prefetch) and one_row and not stages, stages, bool(cfg.reload_rows) and one_row


def add_dropout_norm_bwd_launch(dy, dresidual_out, h, weight, bias, mean, rstd, seed, dropout_p, is_rms_norm,
                                has_residual, x_dtype, residual_dtype, *, launch=plain_launch,
                                config=None):
    """Allocate the grads and run the backward kernel. `config` (a BwdConfig or tuple) overrides the shipped
    launch shape, for sweeps and tests."""
    dx, dresidual, dweight, dbias = _allocate_bwd(dy, h, weight, bias, has_residual, x_dtype, residual_dtype)
    n = h.shape[-1]
    m = rstd.shape[0]
    if m == 0:
        if weight is not None:
            dweight.zero_()
        if bias is not None:
            dbias.zero_()
        return dx, dresidual, dweight, dbias
    h2, dy2, dres_out2 = _rows(h, n), _rows(dy, n), _rows(dresidual_out, n)
    dx2 = dx.view(-1, n)
    dres2 = dresidual.view(-1, n) if has_residual else dx2
    row_bytes = h.element_size() + dy.element_size()
    row_bytes += dresidual_out.element_size() if dresidual_out is not None else 0
    cfg = BwdConfig(*config) if config is not None else bwd_config(n, is_rms_norm, row_bytes)
    block_n, num_chunks = _block_and_chunks(n, cfg.max_fused)
    num_warps = _num_warps(block_n, cfg.elems_per_thread, 32)
    programs = _num_programs(h.device, m, num_warps, cfg.warps_per_sm)
    rows_per_program = cdiv(m, programs)
    if num_chunks == 1:
        # A runtime bound: M splits evenly over the programs, in whole tiles. A tile taller than the
        # program's rows would be mostly masked off: halve it (a loop, as m may be a SymInt).
        rows_per_iter = cfg.rows_per_iter
        while rows_per_iter > 1 and rows_per_iter > rows_per_program:
            rows_per_iter //= 2
        rows_per_program = cdiv(rows_per_program, rows_per_iter) * rows_per_iter
        const_rows_per_program = 1
    else:
        # Chunked rows unroll over the program's rows: a power of two, so that varying M compiles only a few
        # variants. They have no multi-row form.
        rows_per_iter = 1
        rows_per_program = const_rows_per_program = next_power_of_2(rows_per_program)
    programs = cdiv(m, rows_per_program)
    f32 = dict(dtype=torch.float32, device=h.device)
    dw_partial = torch.empty((programs, n), **f32) if weight is not None else None
    db_partial = torch.empty((programs, n), **f32) if bias is not None else None
    has_dropout = dropout_p > 0.0
    prefetch, pipeline_stages, reload_rows = one_row_loop_flags(cfg, rows_per_iter, num_chunks)
    kernel = launch(_add_dropout_norm_bwd_kernel)
    kernel[(programs,)](
        h2, dy2, dres_out2 if dres_out2 is not None else dy2, weight if weight is not None else h2,
        mean if not is_rms_norm else rstd, rstd, seed if has_dropout else rstd,
        dx2, dres2, dw_partial if weight is not None else rstd, db_partial if bias is not None else rstd,
        h2.stride(0), dy2.stride(0), dres_out2.stride(0) if dres_out2 is not None else 0, dx2.stride(0),
        dres2.stride(0), m, rows_per_program, n, cdiv(n, _COLUMNS_PER_CALL),
        dropout_threshold(dropout_p), dropout_scale(dropout_p), ROWS_PER_PROGRAM=const_rows_per_program,
        ROWS_PER_ITER=rows_per_iter,
        PREFETCH=prefetch, PIPELINE_STAGES=pipeline_stages, RELOAD_ROWS=reload_rows,
        BLOCK_N=block_n, NUM_CHUNKS=num_chunks, IS_RMS_NORM=is_rms_norm,
        HAS_DRESIDUAL_OUT=dres_out2 is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        HAS_DROPOUT=has_dropout, STORE_DRESIDUAL=has_residual, num_warps=num_warps,
        **({"num_stages": cfg.num_stages} if cfg.num_stages else {}),
    )
    if weight is not None or bias is not None:
        # an absent parameter's gradient is an empty placeholder (the op returns it), its partial None
        sum_partials(dw_partial, dweight if weight is not None else None, db_partial,
                     dbias if bias is not None else None, launch)
    return dx, dresidual, dweight, dbias


# ----------------------------------------------------------------------------------------------------------
# The registered ops: CUDA through triton_op (Inductor sees the kernels), CPU through the reference
# ----------------------------------------------------------------------------------------------------------


@triton_op("flash::add_dropout_norm_fwd", mutates_args=())
def add_dropout_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    eps: float,
    dropout_p: float,
    is_rms_norm: bool,
    residual_in_fp32: bool,
    return_residual: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (x, residual, weight, bias, seed, eps, dropout_p, is_rms_norm, residual_in_fp32, return_residual)
    if x.device.type != "cuda":
        return _fwd_cpu(*args)
    return add_dropout_norm_fwd_launch(*args, launch=traced_launch)


@triton_op("flash::add_dropout_norm_bwd", mutates_args=())
def add_dropout_norm_bwd(
    dy: torch.Tensor,
    dresidual_out: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    seed: torch.Tensor | None,
    dropout_p: float,
    is_rms_norm: bool,
    has_residual: bool,
    x_dtype: torch.dtype,
    residual_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (dy, dresidual_out, h, weight, bias, mean, rstd, seed, dropout_p, is_rms_norm, has_residual,
            x_dtype, residual_dtype)
    if h.device.type != "cuda":
        return _bwd_cpu(*args)
    return add_dropout_norm_bwd_launch(*args, launch=traced_launch)


add_dropout_norm_fwd.register_kernel("cpu")(_fwd_cpu)
add_dropout_norm_bwd.register_kernel("cpu")(_bwd_cpu)


@add_dropout_norm_fwd.register_fake
def _(x, residual, weight, bias, seed, eps, dropout_p, is_rms_norm, residual_in_fp32, return_residual):
    return _allocate_fwd(x, residual, weight, eps, dropout_p, is_rms_norm, residual_in_fp32, return_residual)


@add_dropout_norm_bwd.register_fake
def _(dy, dresidual_out, h, weight, bias, mean, rstd, seed, dropout_p, is_rms_norm, has_residual, x_dtype,
      residual_dtype):
    return _allocate_bwd(dy, h, weight, bias, has_residual, x_dtype, residual_dtype)


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, seed, eps, dropout_p, is_rms_norm, residual_in_fp32, return_residual = inputs
    _, residual_out, mean, rstd = output
    h = residual_out if residual_out.numel() else x  # empty residual_out: h is x
    ctx.save_for_backward(h, weight, bias, mean, rstd, seed)
    ctx.dropout_p = dropout_p
    ctx.is_rms_norm = is_rms_norm
    ctx.has_residual = residual is not None
    ctx.x_dtype = x.dtype
    ctx.x_shape = x.shape
    ctx.residual_dtype = residual.dtype if residual is not None else x.dtype
    ctx.residual_shape = residual.shape if residual is not None else None
    ctx.h_is_returned = residual_out.numel() > 0
    # Unused outputs (mean, rstd, and the pre-norm sum h of a post-norm block, which the op returns only to
    # save it for backward) get None instead of zero-filled grads. Materialised, h's zeros were a full
    # (M, N) fill kernel per norm and an (M, N) read in the backward kernel: 24 of each in BERT-base's
    # compiled step (bench/logs/kernel_origins_bert_h200.log: triton_poi_fused_view_8, ~0.2 ms a step).
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dresidual_out, dmean, drstd):
    return _backward_with(ctx, dout, dresidual_out, torch.ops.flash.add_dropout_norm_bwd)


def _backward_with(ctx, dout, dresidual_out, add_dropout_norm_bwd_fn):
    """The input grads; dout and dresidual_out may be None (grads are not materialised, _setup_context)."""
    if not ctx.h_is_returned:
        dresidual_out = None
    # Only the pre-norm sum reaches the loss (the norm's output is unused: LLaVA's penultimate-layer features
    # leave the last layer's norm in the graph): the weight and bias get no gradient, None as in eager, not
    # zeros (an optimizer updates a parameter whose grad is a tensor: AdamW's decay, its moments; review s33b)
    norm_reached = dout is not None
    if dout is None:
        if dresidual_out is None:  # nothing reaches the loss
            return (None,) * 10
        dout = torch.zeros(ctx.x_shape, dtype=ctx.x_dtype, device=dresidual_out.device)
    h, weight, bias, mean, rstd, seed = ctx.saved_tensors
    dx, dresidual, dweight, dbias = add_dropout_norm_bwd_fn(
        dout, dresidual_out, h, weight, bias, mean, rstd, seed, ctx.dropout_p, ctx.is_rms_norm,
        ctx.has_residual, ctx.x_dtype, ctx.residual_dtype,
    )
    return (
        dx.view(ctx.x_shape),
        dresidual.view(ctx.residual_shape) if ctx.has_residual else None,
        dweight if weight is not None and norm_reached else None,
        dbias if bias is not None and norm_reached else None,
        None, None, None, None, None, None,
    )


add_dropout_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _DirectAddDropoutNorm(torch.autograd.Function):
    """flash::add_dropout_norm_fwd and its registered autograd, minus the dispatcher (ops/_eager.py)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = add_dropout_norm_fwd_launch(*inputs, launch=plain_launch)
        _setup_context(ctx, inputs, output)  # also turns off zero-filled grads for unused outputs
        return output

    @staticmethod
    def backward(ctx, dout, dresidual_out, dmean, drstd):
        return _backward_with(ctx, dout, dresidual_out,
                              functools.partial(add_dropout_norm_bwd_launch, launch=plain_launch))


# ----------------------------------------------------------------------------------------------------------
# Public function and module
# ----------------------------------------------------------------------------------------------------------


def _check_inputs(x, residual, weight, bias, dropout_p):
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError("add_dropout_norm: x must be a tensor with at least one dimension (..., N)")
    n = x.shape[-1]
    if n < 1 or n > MAX_N:
        raise ValueError(f"add_dropout_norm: x's hidden size N={n} must be in [1, {MAX_N}]")
    for name, t in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):  # (a list raised AttributeError: no attribute 'dtype')
            raise TypeError(f"add_dropout_norm: {name} must be a tensor or None, got {type(t).__name__}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"add_dropout_norm: {name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
        if t.device != x.device:
            raise ValueError(f"add_dropout_norm: {name} is on {t.device} but x is on {x.device}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(
            f"add_dropout_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"add_dropout_norm: {name} shape {tuple(t.shape)} must be ({n},), x's last dim")
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"add_dropout_norm: dropout_p={dropout_p} must be in [0, 1)")


def add_dropout_norm(x, residual=None, weight=None, bias=None, *, eps=1e-5, dropout_p=0.0, is_rms_norm=False,
                     residual_in_fp32=False, return_residual=False):
    """out = norm(dropout(x, dropout_p) + residual) * weight (+ bias); also h when return_residual.

    The dropout seed is drawn from the default generator (reproducible under torch.manual_seed); the mask is
    regenerated from it in backward. When is_rms_norm, bias must be None.
    """
    _check_inputs(x, residual, weight, bias, dropout_p)
    refuse_forward_ad("add_dropout_norm", x, residual, weight, bias)
    if is_rms_norm and bias is not None:
        raise ValueError("add_dropout_norm: bias must be None when is_rms_norm=True")
    dropout_p = float(dropout_p)
    seed = None
    if dropout_p > 0.0:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=x.device)
    inputs = (x, residual, weight, bias, seed, float(eps), dropout_p, bool(is_rms_norm),
              bool(residual_in_fp32), bool(return_residual))
    if direct_call_ok(x, residual, weight, bias):
        if needs_autograd(x, residual, weight, bias):
            out, residual_out, _, _ = _DirectAddDropoutNorm.apply(*inputs)
        else:
            out, residual_out, _, _ = add_dropout_norm_fwd_launch(*inputs, launch=plain_launch)
    else:
        out, residual_out, _, _ = torch.ops.flash.add_dropout_norm_fwd(*inputs)
    return (out, residual_out) if return_residual else out


class AddDropoutNorm(torch.nn.Module):
    """dropout -> residual add -> LayerNorm (or RMSNorm) with an affine weight (and bias for LayerNorm)."""

    def __init__(self, hidden_size, *, eps=1e-5, dropout_p=0.0, is_rms_norm=False, bias=True,
                 residual_in_fp32=False, device=None, dtype=None):
        super().__init__()
        self.eps, self.dropout_p, self.is_rms_norm = eps, dropout_p, is_rms_norm
        self.residual_in_fp32 = residual_in_fp32
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = (torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
                     if bias and not is_rms_norm else None)

    def forward(self, x, residual=None, return_residual=False):
        return add_dropout_norm(
            x, residual, self.weight, self.bias, eps=self.eps,
            dropout_p=self.dropout_p if self.training else 0.0, is_rms_norm=self.is_rms_norm,
            residual_in_fp32=self.residual_in_fp32, return_residual=return_residual,
        )
