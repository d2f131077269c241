"""Triton kernels of flash::add_dropout_norm (see flash_backend/ops/add_dropout_norm.py for the op).

Forward: one program per row. A row of up to BLOCK_N columns is held in registers; wider rows loop over
BLOCK_N-wide chunks (Chan-merged statistics while writing h, then a second pass that re-reads h).
Backward: persistent programs of ROWS_PER_PROGRAM rows each keep their partial dW/dB in registers and write
one partial row each (the launcher sums them). Chunked rows first compute every row's two reductions, then
go chunk-major so the chunk's dW/dB still stay in registers.
Dropout: Philox (`tl.randint4x`), one call per 4 columns, counter = row * cdiv(N, 4) + col // 4, keep when
the top 24 bits of the word are >= round(p * 2**24); `dropout_keep_mask` in the op file is the same in torch.
"""

import triton
import triton.language as tl


@triton.jit
def _mean_of(total, count):
    """total / count rounded correctly. Triton's `/` on fp32 is an approximate division (up to 2 ulp): for
    a row whose values are all equal (N = 1 LayerNorm) h - mean must be exactly 0, else rstd = 1/sqrt(eps)
    amplifies the ulp into a visible error in dx."""
    return tl.math.div_rn(total, count * 1.0)  # count may be an int (N == 1 is specialised to a constexpr)


@triton.jit
def _dropout_keep(seed, row, col_start, n_quads, threshold, BLOCK_N: tl.constexpr):
    """Keep-mask of BLOCK_N columns from col_start (a multiple of 4): one Philox call per 4 columns."""
    quads = col_start // 4 + tl.arange(0, BLOCK_N // 4)
    r0, r1, r2, r3 = tl.randint4x(seed, row * n_quads + quads)
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_N,))
    return (r >> (32 - 24)).to(tl.int32) >= threshold


@triton.jit
def _dropout_add_row(X, RESIDUAL, seed, row, col_start, N, n_quads, threshold, dropout_scale,
                     stride_x_row, stride_res_row, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     HAS_DROPOUT: tl.constexpr):
    cols = col_start + tl.arange(0, BLOCK_N)
    mask = cols < N
    h = tl.load(X + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        h = tl.where(_dropout_keep(seed, row, col_start, n_quads, threshold, BLOCK_N), h * dropout_scale, 0.0)
    if HAS_RESIDUAL:
        h += tl.load(RESIDUAL + row * stride_res_row + cols, mask=mask, other=0.0).to(tl.float32)
    return h


@triton.jit
def _add_dropout_norm_fwd_kernel(
    X,  # (M, N) input
    RESIDUAL,  # (M, N) residual, when HAS_RESIDUAL
    WEIGHT,  # (N,)
    BIAS,  # (N,)
    SEED,  # (1,) int64 dropout seed
    OUT,  # (M, N) normalised output
    RESIDUAL_OUT,  # (M, N) h = dropout(x) + residual, when STORE_RESIDUAL_OUT
    MEAN,  # (M,) fp32, LayerNorm only
    RSTD,  # (M,) fp32
    stride_x_row,  # row strides; columns are contiguous
    stride_res_row,
    stride_out_row,
    stride_res_out_row,
    N,
    n_quads,  # cdiv(N, 4): Philox counters per row
    eps,
    dropout_threshold,
    dropout_scale,
    BLOCK_N: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,  # 1: the row fits in registers; else loop over BLOCK_N-wide chunks
    IS_RMS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    STORE_RESIDUAL_OUT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # Inductor passes Python floats as fp64; the math stays fp32 as in the eager launch.
    eps = tl.cast(eps, tl.float32)
    dropout_scale = tl.cast(dropout_scale, tl.float32)
    seed = tl.load(SEED) if HAS_DROPOUT else 0
    if NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        h = _dropout_add_row(X, RESIDUAL, seed, row, 0, N, n_quads, dropout_threshold, dropout_scale,
                             stride_x_row, stride_res_row, BLOCK_N, HAS_RESIDUAL, HAS_DROPOUT)
        if STORE_RESIDUAL_OUT:
            h = h.to(RESIDUAL_OUT.dtype.element_ty)
            tl.store(RESIDUAL_OUT + row * stride_res_out_row + cols, h, mask=mask)
            h = h.to(tl.float32)
        if IS_RMS_NORM:
            rstd = 1.0 / tl.sqrt(_mean_of(tl.sum(h * h, axis=0), N) + eps)
            y = h * rstd
        else:
            mean = _mean_of(tl.sum(h, axis=0), N)
            hc = tl.where(mask, h - mean, 0.0)
            rstd = 1.0 / tl.sqrt(_mean_of(tl.sum(hc * hc, axis=0), N) + eps)
            tl.store(MEAN + row, mean)
            y = hc * rstd
        tl.store(RSTD + row, rstd)
        if HAS_WEIGHT:
            y = y * tl.load(WEIGHT + cols, mask=mask).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(BIAS + cols, mask=mask).to(tl.float32)
        tl.store(OUT + row * stride_out_row + cols, y.to(OUT.dtype.element_ty), mask=mask)
    else:
        # Pass 1: h chunk by chunk (written out), statistics merged with Chan's formula.
        mean = 0.0
        m2 = 0.0
        for c in range(NUM_CHUNKS):
            col_start = c * BLOCK_N
            cols = col_start + tl.arange(0, BLOCK_N)
            mask = cols < N
            h = _dropout_add_row(X, RESIDUAL, seed, row, col_start, N, n_quads, dropout_threshold,
                                 dropout_scale, stride_x_row, stride_res_row, BLOCK_N, HAS_RESIDUAL,
                                 HAS_DROPOUT)
            if STORE_RESIDUAL_OUT:
                h = h.to(RESIDUAL_OUT.dtype.element_ty)
                tl.store(RESIDUAL_OUT + row * stride_res_out_row + cols, h, mask=mask)
                h = h.to(tl.float32)
            if IS_RMS_NORM:
                m2 += tl.sum(h * h, axis=0)
            else:
                n_prev = (col_start * 1.0)
                n_c = tl.minimum(N - col_start, BLOCK_N) * 1.0
                mean_c = _mean_of(tl.sum(h, axis=0), n_c)
                hc = tl.where(mask, h - mean_c, 0.0)
                delta = mean_c - mean
                total = n_prev + n_c
                mean += delta * (n_c / total)
                m2 += tl.sum(hc * hc, axis=0) + delta * delta * (n_prev * n_c / total)
        rstd = 1.0 / tl.sqrt(_mean_of(m2, N) + eps)
        if not IS_RMS_NORM:
            tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)
        tl.debug_barrier()
        # Pass 2: re-read h (hot in L2) and normalise.
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = cols < N
            if STORE_RESIDUAL_OUT:
                h = tl.load(RESIDUAL_OUT + row * stride_res_out_row + cols, mask=mask, other=0.0)
            else:
                h = tl.load(X + row * stride_x_row + cols, mask=mask, other=0.0)
            h = h.to(tl.float32)
            if IS_RMS_NORM:
                y = h * rstd
            else:
                y = (h - mean) * rstd
            if HAS_WEIGHT:
                y = y * tl.load(WEIGHT + cols, mask=mask).to(tl.float32)
            if HAS_BIAS:
                y = y + tl.load(BIAS + cols, mask=mask).to(tl.float32)
            tl.store(OUT + row * stride_out_row + cols, y.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_chunk(H, DY, WEIGHT, row, cols, mask, mean, rstd, stride_h_row, stride_dy_row,
                    IS_RMS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """(dy, xhat, w * dy) of one chunk of one row, in fp32, zero outside the row."""
    h = tl.load(H + row * stride_h_row + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy_row + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS_NORM:
        xhat = h * rstd
    else:
        xhat = tl.where(mask, (h - mean) * rstd, 0.0)
    if HAS_WEIGHT:
        wdy = dy * tl.load(WEIGHT + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        wdy = dy
    return dy, xhat, wdy


@triton.jit
def _store_input_grads(DRESIDUAL_OUT, DRESIDUAL, DX, seed, row, col_start, mask, dy, xhat, wdy, c1, c2, rstd,
                       n_quads, dropout_threshold, dropout_scale, stride_dres_out_row, stride_dres_row,
                       stride_dx_row, BLOCK_N: tl.constexpr, IS_RMS_NORM: tl.constexpr,
                       HAS_DRESIDUAL_OUT: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                       STORE_DRESIDUAL: tl.constexpr):
    """dh = d(norm)/dh + d(residual_out); store it as the residual's grad, and through dropout as x's."""
    cols = col_start + tl.arange(0, BLOCK_N)
    if IS_RMS_NORM:
        dh = (wdy - xhat * c1) * rstd
    else:
        dh = (wdy - (xhat * c1 + c2)) * rstd
    if HAS_DRESIDUAL_OUT:
        dh += tl.load(DRESIDUAL_OUT + row * stride_dres_out_row + cols, mask=mask, other=0.0).to(tl.float32)
    if STORE_DRESIDUAL:
        tl.store(DRESIDUAL + row * stride_dres_row + cols, dh.to(DRESIDUAL.dtype.element_ty), mask=mask)
    if HAS_DROPOUT:
        dh = tl.where(_dropout_keep(seed, row, col_start, n_quads, dropout_threshold, BLOCK_N),
                      dh * dropout_scale, 0.0)
    tl.store(DX + row * stride_dx_row + cols, dh.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _add_dropout_norm_bwd_kernel(
    H,  # (M, N) the pre-norm sum h (or x when h is x)
    DY,  # (M, N) grad of out
    DRESIDUAL_OUT,  # (M, N) grad of residual_out, when HAS_DRESIDUAL_OUT
    WEIGHT,  # (N,)
    MEAN,  # (M,) fp32, LayerNorm only
    RSTD,  # (M,) fp32
    SEED,  # (1,) int64 dropout seed
    DX,  # (M, N) grad of x
    DRESIDUAL,  # (M, N) grad of residual, when STORE_DRESIDUAL
    DW_PARTIAL,  # (programs, N) fp32 per-program partial dW
    DB_PARTIAL,  # (programs, N) fp32 per-program partial dB
    stride_h_row,  # row strides; columns are contiguous
    stride_dy_row,
    stride_dres_out_row,
    stride_dx_row,
    stride_dres_row,
    M,
    N,
    n_quads,
    dropout_threshold,
    dropout_scale,
    ROWS_PER_PROGRAM: tl.constexpr,  # a power of two; rows past M are masked off
    BLOCK_N: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    IS_RMS_NORM: tl.constexpr,
    HAS_DRESIDUAL_OUT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    STORE_DRESIDUAL: tl.constexpr,
):
    pid = tl.program_id(0)
    dropout_scale = tl.cast(dropout_scale, tl.float32)  # fp64 under Inductor
    row_start = pid * ROWS_PER_PROGRAM
    seed = tl.load(SEED) if HAS_DROPOUT else 0
    if NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK_N)
        dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
        db = tl.zeros((BLOCK_N,), dtype=tl.float32)
        # A while loop over a runtime bound: a constant-trip for loop costs ~90 more registers here (fewer
        # programs per SM), and the interpreter cannot range() over a runtime bound.
        r = row_start
        row_end = tl.minimum(row_start + ROWS_PER_PROGRAM, M)
        while r < row_end:
            row = r.to(tl.int64)
            mean = 0.0 if IS_RMS_NORM else tl.load(MEAN + row)
            rstd = tl.load(RSTD + row)
            mask = cols < N
            dy, xhat, wdy = _norm_bwd_chunk(H, DY, WEIGHT, row, cols, mask, mean, rstd, stride_h_row,
                                            stride_dy_row, IS_RMS_NORM, HAS_WEIGHT)
            if HAS_WEIGHT:
                dw += dy * xhat
            if HAS_BIAS:
                db += dy
            c1 = _mean_of(tl.sum(xhat * wdy, axis=0), N)
            c2 = 0.0 if IS_RMS_NORM else _mean_of(tl.sum(wdy, axis=0), N)
            _store_input_grads(DRESIDUAL_OUT, DRESIDUAL, DX, seed, row, 0, mask, dy, xhat, wdy, c1, c2,
                               rstd, n_quads, dropout_threshold, dropout_scale, stride_dres_out_row,
                               stride_dres_row, stride_dx_row, BLOCK_N, IS_RMS_NORM, HAS_DRESIDUAL_OUT,
                               HAS_DROPOUT, STORE_DRESIDUAL)
            r += 1
        if HAS_WEIGHT:
            tl.store(DW_PARTIAL + pid * N + cols, dw, mask=cols < N)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + pid * N + cols, db, mask=cols < N)
    else:
        # Phase 1: each row's two reductions, kept in registers as vectors over the program's rows.
        row_ids = tl.arange(0, ROWS_PER_PROGRAM)
        c1s = tl.zeros((ROWS_PER_PROGRAM,), dtype=tl.float32)
        c2s = tl.zeros((ROWS_PER_PROGRAM,), dtype=tl.float32)
        for i in range(ROWS_PER_PROGRAM):
            r = row_start + i
            row = tl.minimum(r, M - 1).to(tl.int64)
            mean = 0.0 if IS_RMS_NORM else tl.load(MEAN + row)
            rstd = tl.load(RSTD + row)
            s1 = 0.0
            s2 = 0.0
            for c in range(NUM_CHUNKS):
                cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
                mask = (cols < N) & (r < M)
                dy, xhat, wdy = _norm_bwd_chunk(H, DY, WEIGHT, row, cols, mask, mean, rstd, stride_h_row,
                                                stride_dy_row, IS_RMS_NORM, HAS_WEIGHT)
                s1 += tl.sum(xhat * wdy, axis=0)
                s2 += tl.sum(wdy, axis=0)
            c1s = tl.where(row_ids == i, _mean_of(s1, N), c1s)
            c2s = tl.where(row_ids == i, _mean_of(s2, N), c2s)
        # Phase 2: chunk-major, so that this chunk's dW/dB stay in registers across the program's rows.
        for c in range(NUM_CHUNKS):
            col_start = c * BLOCK_N
            cols = col_start + tl.arange(0, BLOCK_N)
            dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
            db = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for i in range(ROWS_PER_PROGRAM):
                r = row_start + i
                row = tl.minimum(r, M - 1).to(tl.int64)
                mean = 0.0 if IS_RMS_NORM else tl.load(MEAN + row)
                rstd = tl.load(RSTD + row)
                mask = (cols < N) & (r < M)
                dy, xhat, wdy = _norm_bwd_chunk(H, DY, WEIGHT, row, cols, mask, mean, rstd, stride_h_row,
                                                stride_dy_row, IS_RMS_NORM, HAS_WEIGHT)
                if HAS_WEIGHT:
                    dw += dy * xhat
                if HAS_BIAS:
                    db += dy
                c1 = tl.sum(tl.where(row_ids == i, c1s, 0.0), axis=0)
                c2 = tl.sum(tl.where(row_ids == i, c2s, 0.0), axis=0)
                _store_input_grads(DRESIDUAL_OUT, DRESIDUAL, DX, seed, row, col_start, mask, dy, xhat, wdy,
                                   c1, c2, rstd, n_quads, dropout_threshold, dropout_scale,
                                   stride_dres_out_row, stride_dres_row, stride_dx_row, BLOCK_N, IS_RMS_NORM,
                                   HAS_DRESIDUAL_OUT, HAS_DROPOUT, STORE_DRESIDUAL)
            if HAS_WEIGHT:
                tl.store(DW_PARTIAL + pid * N + cols, dw, mask=cols < N)
            if HAS_BIAS:
                tl.store(DB_PARTIAL + pid * N + cols, db, mask=cols < N)
