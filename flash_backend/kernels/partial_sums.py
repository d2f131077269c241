"""Column sums of per-program fp32 partial rows, cast to the parameters' dtype: the last step of a backward
whose programs each keep a partial dW / dB (or bias gradient) in registers and write one row of it.

Used by flash::add_dropout_norm's backward (dW and dB partials) and flash::dense_gelu_bwd's GELU' pass (the
bias gradient's partials). One launch does the sum and the cast: summed by torch, `partial.sum(0).to(dtype)`
was a reduction and a copy per buffer (the norm backward ran four launches; the dense backward's two cost
9 us at M = 16384, N = 3072 on the H200, against ~3 us for this kernel). The sum is deterministic: no atomics.
"""

import torch
import triton
import triton.language as tl

from flash_backend._host_math import cdiv

PARTIAL_TILE = 4096  # elements of one [BLOCK_P, BLOCK_N] tile of the partial sums (16 KB of fp32)


@triton.jit
def _sum_partials_kernel(
    DW_PARTIAL,  # (P, N) fp32: each backward program's dW partial (HAS_WEIGHT)
    DB_PARTIAL,  # (P, N) fp32: each backward program's dB partial (HAS_BIAS)
    DW,  # (N,) out, the weight's dtype
    DB,  # (N,) out, the bias's dtype
    P,  # partial rows
    N,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Both partials in one launch. A program owns BLOCK_N columns and walks the P rows in [BLOCK_P, BLOCK_N]
    # tiles of both buffers, so both sets of loads are in flight.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    dw = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    start = 0
    while start < P:  # a runtime bound: the interpreter cannot range() over one
        rows = start + tl.arange(0, BLOCK_P)
        offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
        mask = (rows[:, None] < P) & col_mask[None, :]
        if HAS_WEIGHT:
            dw += tl.load(DW_PARTIAL + offsets, mask=mask, other=0.0)
        if HAS_BIAS:
            db += tl.load(DB_PARTIAL + offsets, mask=mask, other=0.0)
        start += BLOCK_P
    if HAS_WEIGHT:
        tl.store(DW + cols, tl.sum(dw, axis=0).to(DW.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB + cols, tl.sum(db, axis=0).to(DB.dtype.element_ty), mask=col_mask)


def partial_sums_block(n: int) -> int:
    """Columns per program of _sum_partials_kernel: ~128 programs or more (N=768: 48 programs of 16 columns),
    16 to 128 columns each."""
    block = 16
    while block < 128 and n // (2 * block) >= 128:
        block *= 2
    return block


def sum_partials(dw_partial: torch.Tensor | None, dw: torch.Tensor | None, db_partial: torch.Tensor | None,
                 db: torch.Tensor | None, launch) -> None:
    """dw = dw_partial.sum(0), db = db_partial.sum(0) (in dw's / db's dtype), in one launch; either
    (partial, out) pair may be (None, None). The partials are (P, N) contiguous fp32 with P >= 1, the outs
    (N,); `launch` wraps the kernel (traced_launch inside an op's body, plain_launch in eager calls)."""
    has_weight, has_bias = dw is not None, db is not None
    if has_weight != (dw_partial is not None) or has_bias != (db_partial is not None):
        raise ValueError("sum_partials: each partial needs its output, and each output its partial")
    some_partial = dw_partial if has_weight else db_partial
    programs, n = some_partial.shape
    block_n = partial_sums_block(n)
    launch(_sum_partials_kernel)[(cdiv(n, block_n),)](
        dw_partial if has_weight else some_partial, db_partial if has_bias else some_partial,
        dw if has_weight else some_partial, db if has_bias else some_partial, programs, n,
        HAS_WEIGHT=has_weight, HAS_BIAS=has_bias, BLOCK_P=PARTIAL_TILE // block_n, BLOCK_N=block_n,
        num_warps=4)
