"""The erf GELU's forward pass, and GELU's backward with the bias gradient in one pass, for the
flash::dense_gelu_* ops (ops/dense.py).

A lone Linear + GELU has no GEMM whose output is the gradient of the activation (that GEMM belongs to the
next layer), so GELU' cannot ride in a cuBLASLt epilogue. It takes one pass over (M, N): grad_pre =
grad_out * GELU'(pre), stored, and in the same pass the bias gradient's column sums, while grad_pre is
still in registers. Before, that was aten.gelu_backward (read 2, write 1) and then a BGRADB epilogue on the
weight-gradient GEMM that read grad_pre again and slowed the GEMM by 1-30 % (bench/NOTES_dense.md), or, in
Inductor's graph, a pointwise kernel plus a reduction that re-reads it.

Layout of the pass: program (i, j) owns columns [j * BLOCK_N, (j + 1) * BLOCK_N) of the row chunk
[i * rows_per_program, (i + 1) * rows_per_program) and walks it BLOCK_M rows at a time, adding grad_pre
into an fp32 [BLOCK_M, BLOCK_N] register tile that is reduced over its rows once, at the end. The column
sums go to row i of an fp32 (row chunks, N) buffer that the caller sums (a few hundred KB: one small
reduction, deterministic, no atomics). They are sums of grad_pre as stored (rounded to the output dtype),
which is what eager's `grad_pre.sum(0)` sums.

GELU' is computed in fp32 and grad_pre rounded once to the output dtype, as aten's gelu_backward does.

The forward pass exists for the exact (erf) GELU, which no cuBLASLt epilogue computes (the GEMM writes the
pre-activation, this pass the activation). libdevice's erf is ~30 instructions, two branches that a warp of
mixed-sign inputs runs both of: the elementwise pass then runs at ~65 % of copy speed (Inductor's and aten's
alike, bench/NOTES_dense.md). The normal CDF by Abramowitz & Stegun 7.1.26 (one exp, one reciprocal, five
FMAs, no branch) is accurate to 7.5e-8 absolute, which is finer than fp32's own cancellation in aten's
0.5 x (1 + erf(x / sqrt 2)) for negative x.
"""

import triton
import triton.language as tl

from flash_backend.kernels.linear_gelu_kernels import SQRT_1_2, TWO_SQRT_2_PI, _gelu

INV_SQRT_2PI: tl.constexpr = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)


@triton.jit
def _normal_cdf_poly(x, gauss):
    """Phi(x) in fp32 from x and gauss = exp(-x^2 / 2), by the normal tail P(Z > |x|) = 0.5 erfc(|x| / sqrt 2)
    of Abramowitz & Stegun 7.1.26, whose e^(-z^2) is gauss: absolute error <= 7.5e-8. The tail form keeps Phi
    accurate for negative x (no 1 - 1 cancels)."""
    t = 1.0 / (1.0 + 0.2316418882 * tl.abs(x))  # A&S's p = 0.3275911 times 1 / sqrt 2
    tail = 0.5 * gauss * t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (
        -1.453152027 + t * 1.061405429))))
    return tl.where(x >= 0, 1.0 - tail, tail)


@triton.jit
def _gelu_grad(x, APPROXIMATE_TANH: tl.constexpr, POLY_CDF: tl.constexpr):
    """d gelu(x) / dx in fp32, for x in fp32."""
    if APPROXIMATE_TANH:
        # gelu(x) = x * s with s = sigmoid(2 y) = 0.5 (1 + tanh(y)), y = sqrt(2 / pi) (x + 0.044715 x^3):
        # gelu' = s + x * ds/dx = s + 2 x s (1 - s) y'(x), y' = sqrt(2 / pi) (1 + 3 * 0.044715 x^2): the 2
        # and sqrt(2 / pi) make the forward's TWO_SQRT_2_PI.
        s = tl.sigmoid(TWO_SQRT_2_PI * (x + 0.044715 * x * x * x))
        return s + x * s * (1.0 - s) * TWO_SQRT_2_PI * (1.0 + 0.134145 * x * x)
    # gelu(x) = x * Phi(x): gelu' = Phi(x) + x * phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
    gauss = tl.exp(-0.5 * x * x)
    if POLY_CDF:
        # One exp for both terms instead of libdevice's erf (~30 instructions) and an exp, which made the
        # pass compute-bound at ~40 instructions per 6 bytes moved. Absolute error of gelu' <= 3e-7 in fp32
        # (libdevice's erf: 1.4e-7), under the 1/256 .. 1/2048 relative rounding of the bf16 / fp16 result.
        cdf = _normal_cdf_poly(x, gauss)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(x * SQRT_1_2))
    return cdf + x * INV_SQRT_2PI * gauss


@triton.jit
def _gelu_erf_fwd_kernel(
    PRE,  # (numel,) pre-activation, contiguous
    OUT,  # (numel,) out: gelu(pre) (erf), contiguous; may be PRE itself (in place)
    numel,
    BLOCK: tl.constexpr,
    POLY_CDF: tl.constexpr,  # the CDF by _normal_cdf_poly; else libdevice's erf (for the A/B in bench_dense)
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offs < numel
    x = tl.load(PRE + offs, mask=in_bounds, other=0.0).to(tl.float32)
    if POLY_CDF:
        y = x * _normal_cdf_poly(x, tl.exp(-0.5 * x * x))
    else:
        y = _gelu(x, False)  # libdevice's erf, as the Triton matmul's epilogue computes it
    tl.store(OUT + offs, y.to(OUT.dtype.element_ty), mask=in_bounds)


@triton.jit
def _gelu_bwd_dbias_kernel(
    GRAD_OUT,  # (M, N) gradient of gelu(pre), contiguous
    PRE,  # (M, N) pre-activation saved by the forward, contiguous
    GRAD_PRE,  # (M, N) out: grad_out * gelu'(pre), contiguous
    DBIAS_PARTIAL,  # (cdiv(M, rows_per_program), N) fp32 out: column sums of GRAD_PRE per row chunk
    M,
    N,
    rows_per_program,  # a multiple of BLOCK_M, so the chunks tile the rows exactly
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    APPROXIMATE_TANH: tl.constexpr,
    STORE_DBIAS: tl.constexpr,
    STAGES: tl.constexpr,  # > 1: Triton pipelines the row loop's loads (cp.async, STAGES - 1 tiles ahead)
    POLY_CDF: tl.constexpr,  # erf GELU's normal CDF by a polynomial sharing the density's exp (_gelu_grad)
):
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    tile = tl.arange(0, BLOCK_M)[:, None] * N + cols[None, :]  # int32 offsets inside a BLOCK_M-row tile
    # Column sums accumulate elementwise in a [BLOCK_M, BLOCK_N] tile and are reduced across rows once, at
    # the end: a row reduction per tile (a shared-memory round trip and a barrier between the loads of
    # consecutive tiles) ran at 0.67-0.92x aten's speed on the H200, this form at 1.14x (NOTES_dense.md).
    sums = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first_row = chunk * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, M)
    for start in tl.range(first_row, last_row, BLOCK_M, num_stages=STAGES):
        in_bounds = ((start + tl.arange(0, BLOCK_M)) < last_row)[:, None] & col_ok[None, :]
        row0 = tl.cast(start, tl.int64) * N
        grad = tl.load(GRAD_OUT + row0 + tile, mask=in_bounds, other=0.0).to(tl.float32)
        pre = tl.load(PRE + row0 + tile, mask=in_bounds, other=0.0).to(tl.float32)
        grad_pre = (grad * _gelu_grad(pre, APPROXIMATE_TANH, POLY_CDF)).to(GRAD_PRE.dtype.element_ty)
        tl.store(GRAD_PRE + row0 + tile, grad_pre, mask=in_bounds)
        if STORE_DBIAS:
            sums += grad_pre.to(tl.float32)  # masked lanes loaded 0: they add 0
    if STORE_DBIAS:
        tl.store(DBIAS_PARTIAL + chunk.to(tl.int64) * N + cols, tl.sum(sums, axis=0), mask=col_ok)
