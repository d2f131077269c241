"""Triton matmul with the bias and GELU in its epilogue: the Triton path of flash::dense_gelu_* (the op and
the per-shape choice between it and cuBLASLt live in flash_backend/ops/dense.py).

Why a Triton matmul at all: cuBLASLt's GELU epilogues compute the tanh approximation only, so an exact
(erf) GELU after a cuBLASLt GEMM costs one more pass over the (M, N) activations. Here the GEMM's
epilogue computes either GELU, adds the bias, and stores the activation and (for the backward) the
pre-activation, while the tile is still in registers.

The kernel is the classic tiled one: programs grouped GROUP_M tiles down a column of the output so that
consecutive programs reuse the same weight tiles from L2; row and column offsets wrap modulo M and N so
that the main loop's loads need no masks (the wrapped rows and columns are computed and never stored);
K is a compile-time constant (one specialisation per layer width), so the loop has a fixed trip count and
only a ragged last K tile is masked. fp32 accumulation; the epilogue in fp32.
"""

import triton
import triton.language as tl

SQRT_1_2: tl.constexpr = tl.constexpr(0.7071067811865476)
TWO_SQRT_2_PI: tl.constexpr = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi)


@triton.jit
def _gelu(pre, APPROXIMATE_TANH: tl.constexpr):
    if APPROXIMATE_TANH:
        # 0.5 * (1 + tanh(y)) == sigmoid(2 y), with y = sqrt(2 / pi) * (x + 0.044715 x^3)
        return pre * tl.sigmoid(TWO_SQRT_2_PI * (pre + 0.044715 * pre * pre * pre))
    return 0.5 * pre * (1.0 + tl.math.erf(pre * SQRT_1_2))


@triton.jit
def _linear_gelu_fwd_kernel(
    X,  # (M, K), unit column stride; row stride stride_x
    W,  # (N, K) like nn.Linear.weight, unit column stride; row stride stride_w
    BIAS,  # (N,) (HAS_BIAS)
    OUT,  # (M, N) out: gelu(x @ W^T + bias), contiguous
    PRE,  # (M, N) out: x @ W^T + bias (STORE_PRE), contiguous
    M,  # rows
    N,  # output features
    stride_x,  # row stride of X
    stride_w,  # row stride of W
    K: tl.constexpr,  # input features
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    APPROXIMATE_TANH: tl.constexpr,
    STORE_PRE: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * tiles_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % group_size) % rows_in_group
    tile_n = (pid % group_size) // rows_in_group

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + (rows % M).to(tl.int64)[:, None] * stride_x + ks[None, :]
    w_ptrs = W + (cols % N).to(tl.int64)[None, :] * stride_w + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if K % BLOCK_K == 0:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_left = K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=ks[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=ks[:, None] < k_left, other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    in_bounds = (rows[:, None] < M) & (cols[None, :] < N)
    # Eager's F.linear rounds the pre-activation to the output dtype before F.gelu sees it: so do we (and
    # the backward then differentiates exactly the pre-activation stored).
    pre = acc.to(OUT.dtype.element_ty)
    if STORE_PRE:
        tl.store(PRE + offsets, pre, mask=in_bounds)
    out = _gelu(pre.to(tl.float32), APPROXIMATE_TANH)
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=in_bounds)
