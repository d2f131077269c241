"""Triton kernels of flash::add_dropout_norm (see flash_backend/ops/add_dropout_norm.py for the op).

Forward: one program per row. A row of up to BLOCK_N columns is held in registers; wider rows loop over
BLOCK_N-wide chunks (Chan-merged statistics while writing h, then a second pass that re-reads h).
Backward: persistent programs of rows_per_program rows each keep their partial dW/dB in registers and write
one partial row each, which kernels/partial_sums.py then sums (one launch for dW and dB). A row that fits in
registers is handled one row per loop iteration (ROWS_PER_ITER = 1: a loop Triton pipelines through shared
memory, PIPELINE_STAGES > 0, or one that prefetches the next row into registers by hand, PREFETCH) or as a
[ROWS_PER_ITER, BLOCK_N] tile, which puts several rows' loads in flight before the block-wide reductions
stall the program. Chunked rows first compute every row's two reductions, then go chunk-major so the
chunk's dW/dB still stay in registers.
Dropout: Philox-4x32-7 (`tl.randint4x`), one call per 8 columns, counter = row * cdiv(N, 8) + col // 8;
column col takes the 16-bit half col % 2 (low half first) of word (col % 8) // 2 and is kept when that half is
>= round(p * 65536); `dropout_keep_mask` in the op file is the same in torch. (It was one 10-round call per
4 columns with 24-bit thresholds: Philox's integer work was ~20% of the forward at N=768.)
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
def _means_of(totals, count):
    """_mean_of for a vector of totals: div_rn does not broadcast a scalar divisor."""
    return tl.math.div_rn(totals, tl.full(totals.shape, count, tl.float32))


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _halves_at_least(r0, r1, r2, r3, threshold, SHAPE: tl.constexpr):
    """Keep-mask from Philox words of one call per 8 columns, laid out as SHAPE: column 8c + 2w + e takes
    half e of word w of call c."""
    # join appends a minor axis: join(join(r0, r2), join(r1, r3)) flattens to the words in order 0..3.
    words = tl.join(tl.join(r0, r2), tl.join(r1, r3))
    halves = tl.reshape(tl.join(words & 0xFFFF, words >> 16), SHAPE)
    return halves.to(tl.int32) >= threshold  # halves < 2**16: the cast keeps the value


@triton.jit
def _dropout_keep(seed, row, col_start, n_calls, threshold, BLOCK_N: tl.constexpr):
    """Keep-mask of BLOCK_N columns from col_start (a multiple of 8): one Philox-4x32-7 call per 8 columns."""
    calls = col_start // 8 + tl.arange(0, BLOCK_N // 8)
    # 7 rounds: DROPOUT_PHILOX_ROUNDS of ops/_philox.py (a literal: n_rounds must be a compile-time constant).
    r0, r1, r2, r3 = tl.randint4x(seed, row * n_calls + calls, n_rounds=7)
    return _halves_at_least(r0, r1, r2, r3, threshold, (BLOCK_N,))


@triton.jit
def _dropout_keep_rows(seed, rows, n_calls, threshold, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """_dropout_keep of the first BLOCK_N columns of each of `rows` (int64): the same counters, so the same
    mask as the one-row form."""
    calls = tl.arange(0, BLOCK_N // 8)
    r0, r1, r2, r3 = tl.randint4x(seed, rows[:, None] * n_calls + calls[None, :], n_rounds=7)
    return _halves_at_least(r0, r1, r2, r3, threshold, (ROWS, BLOCK_N))


@triton.jit
def _dropout_add_row(X, RESIDUAL, seed, row, col_start, N, n_calls, threshold, dropout_scale,
                     stride_x_row, stride_res_row, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     HAS_DROPOUT: tl.constexpr):
    cols = col_start + tl.arange(0, BLOCK_N)
    mask = cols < N
    h = tl.load(X + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        h = tl.where(_dropout_keep(seed, row, col_start, n_calls, threshold, BLOCK_N), h * dropout_scale, 0.0)
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
    n_calls,  # cdiv(N, 8): Philox calls per row
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
        h = _dropout_add_row(X, RESIDUAL, seed, row, 0, N, n_calls, dropout_threshold, dropout_scale,
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
            h = _dropout_add_row(X, RESIDUAL, seed, row, col_start, N, n_calls, dropout_threshold,
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
def _load_bwd_row(H, DY, DRESIDUAL_OUT, MEAN, RSTD, r, row_end, cols, mask, stride_h_row, stride_dy_row,
                  stride_dres_out_row, IS_RMS_NORM: tl.constexpr, HAS_DRESIDUAL_OUT: tl.constexpr):
    """Row r's inputs as stored (h, dy, d(residual_out), mean, rstd); all zero when r is not below row_end,
    which then reads no memory."""
    valid = r < row_end
    row = r.to(tl.int64)
    row_mask = mask & valid
    h = tl.load(H + row * stride_h_row + cols, mask=row_mask, other=0.0)
    dy = tl.load(DY + row * stride_dy_row + cols, mask=row_mask, other=0.0)
    if HAS_DRESIDUAL_OUT:
        dres_out = tl.load(DRESIDUAL_OUT + row * stride_dres_out_row + cols, mask=row_mask, other=0.0)
    else:
        dres_out = 0.0
    mean = 0.0 if IS_RMS_NORM else tl.load(MEAN + row, mask=valid, other=0.0)
    rstd = tl.load(RSTD + row, mask=valid, other=0.0)
    return h, dy, dres_out, mean, rstd


@triton.jit
def _row_means(xhat, wdy, N, IS_RMS_NORM: tl.constexpr, ONE_REDUCTION: tl.constexpr):
    """(mean(xhat * w dy), mean(w dy)) of one row (RMSNorm's second is 0). ONE_REDUCTION: LayerNorm's two
    sums in one block reduction, one set of barriers: on the H200 1.05x for the pipelined loop at N=4096,
    but 1.14-1.16x slower at N=768-1024 (bench/logs/sweep_bwd_one_reduction_h200.log)."""
    if IS_RMS_NORM:
        return _mean_of(tl.sum(xhat * wdy, axis=0), N), 0.0
    if ONE_REDUCTION:
        s1, s2 = tl.reduce((xhat * wdy, wdy), 0, _add_pair)
        return _mean_of(s1, N), _mean_of(s2, N)
    return _mean_of(tl.sum(xhat * wdy, axis=0), N), _mean_of(tl.sum(wdy, axis=0), N)


@triton.jit
def _load_weight(WEIGHT, cols, mask, HAS_WEIGHT: tl.constexpr):
    return tl.load(WEIGHT + cols, mask=mask, other=0.0).to(tl.float32) if HAS_WEIGHT else 1.0


@triton.jit
def _norm_bwd_terms(h, dy, w, mask, mean, rstd, IS_RMS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """(dy, xhat, w * dy) in fp32 from a chunk of h and dy as loaded (zero outside the row), w the weight's
    chunk in fp32 (_load_weight)."""
    h = h.to(tl.float32)
    dy = dy.to(tl.float32)
    if IS_RMS_NORM:
        xhat = h * rstd
    else:
        xhat = tl.where(mask, (h - mean) * rstd, 0.0)
    if HAS_WEIGHT:
        wdy = _rounded(mask, dy * w)
    else:
        wdy = dy
    return dy, xhat, wdy


@triton.jit
def _norm_bwd_chunk(H, DY, WEIGHT, row, cols, mask, mean, rstd, stride_h_row, stride_dy_row,
                    IS_RMS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, EVICTION: tl.constexpr):
    """(dy, xhat, w * dy) of one chunk of one row, in fp32, zero outside the row.

    EVICTION is the loads' eviction hint: "" for a row's first read; "evict_first" where the one-row loops
    read a row again after its reductions (RELOAD_ROWS). That second read hits L1 or L2, not HBM, so the
    row's fp32 xhat and w * dy need not stay in registers through the block reductions; and since its hint
    differs from the first load's, the compiler cannot merge the two loads back into one."""
    h = tl.load(H + row * stride_h_row + cols, mask=mask, other=0.0, eviction_policy=EVICTION)
    dy = tl.load(DY + row * stride_dy_row + cols, mask=mask, other=0.0, eviction_policy=EVICTION)
    return _norm_bwd_terms(h, dy, _load_weight(WEIGHT, cols, mask, HAS_WEIGHT), mask, mean, rstd, IS_RMS_NORM,
                           HAS_WEIGHT)


@triton.jit
def _rounded(mask, product):
    """product, rounded to fp32 before any later use. Without the select, the compiler may contract
    `w * dy - mean(w * dy)` into one FMA that subtracts the *rounded* mean from the *unrounded* product: for
    an N = 1 LayerNorm, where the two are equal and rstd = 1/sqrt(eps), that leaves ulp * 316 in dx."""
    return tl.where(mask, product, 0.0)


@triton.jit
def _store_input_grads(DRESIDUAL, DX, seed, row, col_start, mask, dres_out, xhat, wdy, c1, c2, rstd, n_calls,
                       dropout_threshold, dropout_scale, stride_dres_row, stride_dx_row,
                       BLOCK_N: tl.constexpr, IS_RMS_NORM: tl.constexpr, HAS_DRESIDUAL_OUT: tl.constexpr,
                       HAS_DROPOUT: tl.constexpr, STORE_DRESIDUAL: tl.constexpr):
    """dh = d(norm)/dh + d(residual_out) (dres_out, as loaded); store it as the residual's grad, and through
    dropout as x's."""
    cols = col_start + tl.arange(0, BLOCK_N)
    if IS_RMS_NORM:
        dh = (wdy - xhat * c1) * rstd
    else:
        dh = (wdy - (xhat * c1 + c2)) * rstd
    if HAS_DRESIDUAL_OUT:
        dh += dres_out.to(tl.float32)
    if STORE_DRESIDUAL:
        tl.store(DRESIDUAL + row * stride_dres_row + cols, dh.to(DRESIDUAL.dtype.element_ty), mask=mask)
    if HAS_DROPOUT:
        dh = tl.where(_dropout_keep(seed, row, col_start, n_calls, dropout_threshold, BLOCK_N),
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
    rows_per_program,  # rows of each program (the last one stops at M)
    N,
    n_calls,
    dropout_threshold,
    dropout_scale,
    # Chunked rows (NUM_CHUNKS > 1) unroll over the program's rows: there rows_per_program == this, a power
    # of two (rows past M are masked off); fused rows loop to a runtime bound and ignore it.
    ROWS_PER_PROGRAM: tl.constexpr,
    ROWS_PER_ITER: tl.constexpr,  # rows per loop iteration of a fused row (NUM_CHUNKS == 1); a power of two
    PREFETCH: tl.constexpr,  # one-row loop only: row r + 1's loads are issued before row r's work
    # > 0 (one-row loop only): a for loop that Triton software-pipelines, this many rows in flight
    PIPELINE_STAGES: tl.constexpr,
    # one-row loops: read the row's h and dy again after its reductions instead of holding its fp32 terms
    # in registers through them (_norm_bwd_chunk's EVICTION)
    RELOAD_ROWS: tl.constexpr,
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
    row_start = pid * rows_per_program
    seed = tl.load(SEED) if HAS_DROPOUT else 0
    if NUM_CHUNKS == 1 and ROWS_PER_ITER == 1 and PIPELINE_STAGES > 0:
        # One row per iteration of a loop with a num_stages: Triton's pipeliner turns the row loads (h, dy,
        # d(residual_out)) into asynchronous copies to shared memory, PIPELINE_STAGES - 1 rows ahead, so
        # HBM keeps working through each row's block reductions and stores without the registers a row
        # prefetched by hand costs. The loads qualify only with 4+ byte vectors, i.e. when the launcher's N
        # is known to be a multiple of 16 (Triton's integer specialisation): else this is the plain loop.
        # The trip count is the same for every program (a runtime argument: constant-trip loops cost
        # registers); rows past the program's end load nothing and store nothing.
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
        db = tl.zeros((BLOCK_N,), dtype=tl.float32)
        row_end = tl.minimum(row_start + rows_per_program, M)
        for i in tl.range(0, rows_per_program, num_stages=PIPELINE_STAGES):
            r = row_start + i
            h, dy, dres_out, mean, rstd = _load_bwd_row(H, DY, DRESIDUAL_OUT, MEAN, RSTD, r, row_end, cols,
                                                        mask, stride_h_row, stride_dy_row,
                                                        stride_dres_out_row, IS_RMS_NORM, HAS_DRESIDUAL_OUT)
            # The weight is re-read (from L1/L2) every row: held in registers across the loop it made
            # LayerNorm at N=4096 1.18x slower on the H200 (e243f15 vs 53bbf3f sweeps).
            w = _load_weight(WEIGHT, cols, mask, HAS_WEIGHT)
            dy32, xhat, wdy = _norm_bwd_terms(h, dy, w, mask, mean, rstd, IS_RMS_NORM, HAS_WEIGHT)
            if HAS_WEIGHT:
                dw += dy32 * xhat  # zero on rows past the end: their h and dy load as zeros, rstd as 0
            if HAS_BIAS:
                db += dy32
            c1, c2 = _row_means(xhat, wdy, N, IS_RMS_NORM, BLOCK_N >= 4096)
            if RELOAD_ROWS:
                _, xhat, wdy = _norm_bwd_chunk(H, DY, WEIGHT, r.to(tl.int64), cols, mask & (r < row_end),
                                               mean, rstd, stride_h_row, stride_dy_row, IS_RMS_NORM,
                                               HAS_WEIGHT, "evict_first")
            _store_input_grads(DRESIDUAL, DX, seed, r.to(tl.int64), 0, mask & (r < row_end), dres_out, xhat,
                               wdy, c1, c2, rstd, n_calls, dropout_threshold, dropout_scale, stride_dres_row,
                               stride_dx_row, BLOCK_N, IS_RMS_NORM, HAS_DRESIDUAL_OUT, HAS_DROPOUT,
                               STORE_DRESIDUAL)
        if HAS_WEIGHT:
            tl.store(DW_PARTIAL + pid * N + cols, dw, mask=mask)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + pid * N + cols, db, mask=mask)
    elif NUM_CHUNKS == 1 and ROWS_PER_ITER == 1:
        # One row per iteration. With PREFETCH the loop is software-pipelined: the next row's loads are
        # issued before this row's two block reductions (barriers) and stores, so that HBM keeps working
        # while a row is reduced; the second row in flight costs its registers (two rows ahead measured
        # slower at every N on the H200). Without it a row loads d(residual_out) only after its reductions:
        # the fewest registers, which wins for LayerNorm at N <= 1024 and for the 16384-column rows kept in
        # registers (bench/logs/sweep_bwd_prefetch_h200.log).
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
        db = tl.zeros((BLOCK_N,), dtype=tl.float32)
        # A while loop over a runtime bound: a constant-trip for loop costs ~90 more registers here (fewer
        # programs per SM), and the interpreter cannot range() over a runtime bound.
        r = row_start
        row_end = tl.minimum(row_start + rows_per_program, M)
        if PREFETCH:
            h, dy, dres_out, mean, rstd = _load_bwd_row(H, DY, DRESIDUAL_OUT, MEAN, RSTD, r, row_end, cols,
                                                        mask, stride_h_row, stride_dy_row,
                                                        stride_dres_out_row, IS_RMS_NORM, HAS_DRESIDUAL_OUT)
        while r < row_end:
            row = r.to(tl.int64)
            if PREFETCH:
                h_next, dy_next, dres_out_next, mean_next, rstd_next = _load_bwd_row(
                    H, DY, DRESIDUAL_OUT, MEAN, RSTD, r + 1, row_end, cols, mask, stride_h_row, stride_dy_row,
                    stride_dres_out_row, IS_RMS_NORM, HAS_DRESIDUAL_OUT)
            else:
                h, dy, dres_out, mean, rstd = _load_bwd_row(H, DY, DRESIDUAL_OUT, MEAN, RSTD, r, row_end,
                                                            cols, mask, stride_h_row, stride_dy_row,
                                                            stride_dres_out_row, IS_RMS_NORM, False)
            w = _load_weight(WEIGHT, cols, mask, HAS_WEIGHT)  # per row: no registers held across rows
            dy32, xhat, wdy = _norm_bwd_terms(h, dy, w, mask, mean, rstd, IS_RMS_NORM, HAS_WEIGHT)
            if HAS_WEIGHT:
                dw += dy32 * xhat
            if HAS_BIAS:
                db += dy32
            c1, c2 = _row_means(xhat, wdy, N, IS_RMS_NORM, False)
            if RELOAD_ROWS:
                _, xhat, wdy = _norm_bwd_chunk(H, DY, WEIGHT, row, cols, mask, mean, rstd, stride_h_row,
                                               stride_dy_row, IS_RMS_NORM, HAS_WEIGHT, "evict_first")
            if HAS_DRESIDUAL_OUT and not PREFETCH:
                dres_out = tl.load(DRESIDUAL_OUT + row * stride_dres_out_row + cols, mask=mask, other=0.0)
            _store_input_grads(DRESIDUAL, DX, seed, row, 0, mask, dres_out, xhat, wdy, c1, c2, rstd, n_calls,
                               dropout_threshold, dropout_scale, stride_dres_row, stride_dx_row, BLOCK_N,
                               IS_RMS_NORM, HAS_DRESIDUAL_OUT, HAS_DROPOUT, STORE_DRESIDUAL)
            if PREFETCH:
                h, dy, dres_out, mean, rstd = h_next, dy_next, dres_out_next, mean_next, rstd_next
            r += 1
        if HAS_WEIGHT:
            tl.store(DW_PARTIAL + pid * N + cols, dw, mask=mask)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + pid * N + cols, db, mask=mask)
    elif NUM_CHUNKS == 1:
        # A [ROWS_PER_ITER, BLOCK_N] tile per iteration. The row reductions are block-wide (barriers), so
        # everything that does not depend on them is issued first: the loads of all the tile's rows
        # (dresidual_out too, which the one-row path loads only after its reductions) and the Philox mask,
        # whose ALU work then overlaps the load latency. Per-row values stay [ROWS_PER_ITER, 1] (keep_dims),
        # in the tile's own layout.
        cols = tl.arange(0, BLOCK_N)[None, :]
        col_mask = cols < N
        dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
        db = tl.zeros((BLOCK_N,), dtype=tl.float32)
        r = row_start
        row_end = tl.minimum(row_start + rows_per_program, M)
        while r < row_end:
            rows = r + tl.arange(0, ROWS_PER_ITER)
            in_range = rows < row_end
            rows = rows.to(tl.int64)
            mask = in_range[:, None] & col_mask
            h = tl.load(H + rows[:, None] * stride_h_row + cols, mask=mask, other=0.0)
            dy = tl.load(DY + rows[:, None] * stride_dy_row + cols, mask=mask, other=0.0)
            dres_out = tl.load(DRESIDUAL_OUT + rows[:, None] * stride_dres_out_row + cols, mask=mask,
                               other=0.0) if HAS_DRESIDUAL_OUT else 0.0
            w = tl.load(WEIGHT + cols, mask=col_mask, other=0.0) if HAS_WEIGHT else 1.0
            # Loaded as [ROWS_PER_ITER] then expanded: a [ROWS_PER_ITER, 1] load would be issued once per
            # column a thread holds. rstd = 0 on masked-off rows makes their dh 0.
            rstd = tl.load(RSTD + rows, mask=in_range, other=0.0)[:, None]
            mean = 0.0 if IS_RMS_NORM else tl.load(MEAN + rows, mask=in_range, other=0.0)[:, None]
            if HAS_DROPOUT:
                keep = _dropout_keep_rows(seed, rows, n_calls, dropout_threshold, ROWS_PER_ITER, BLOCK_N)
            h = h.to(tl.float32)
            dy = dy.to(tl.float32)
            if IS_RMS_NORM:
                xhat = h * rstd
            else:
                xhat = tl.where(mask, (h - mean) * rstd, 0.0)
            wdy = _rounded(mask, dy * w.to(tl.float32)) if HAS_WEIGHT else dy
            if HAS_WEIGHT:
                dw += tl.sum(dy * xhat, axis=0)
            if HAS_BIAS:
                db += tl.sum(dy, axis=0)
            if IS_RMS_NORM:
                c1 = _means_of(tl.sum(xhat * wdy, axis=1, keep_dims=True), N)
                dh = (wdy - xhat * c1) * rstd
            else:
                # One reduction of both sums: one set of barriers instead of two.
                s1, s2 = tl.reduce((xhat * wdy, wdy), 1, _add_pair, keep_dims=True)
                dh = (wdy - (xhat * _means_of(s1, N) + _means_of(s2, N))) * rstd
            if HAS_DRESIDUAL_OUT:
                dh += dres_out.to(tl.float32)
            if STORE_DRESIDUAL:
                tl.store(DRESIDUAL + rows[:, None] * stride_dres_row + cols,
                         dh.to(DRESIDUAL.dtype.element_ty), mask=mask)
            if HAS_DROPOUT:
                dh = tl.where(keep, dh * dropout_scale, 0.0)
            tl.store(DX + rows[:, None] * stride_dx_row + cols, dh.to(DX.dtype.element_ty), mask=mask)
            r += ROWS_PER_ITER
        cols = tl.arange(0, BLOCK_N)
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
                                                stride_dy_row, IS_RMS_NORM, HAS_WEIGHT, "")
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
                                                stride_dy_row, IS_RMS_NORM, HAS_WEIGHT, "")
                if HAS_WEIGHT:
                    dw += dy * xhat
                if HAS_BIAS:
                    db += dy
                c1 = tl.sum(tl.where(row_ids == i, c1s, 0.0), axis=0)
                c2 = tl.sum(tl.where(row_ids == i, c2s, 0.0), axis=0)
                if HAS_DRESIDUAL_OUT:
                    dres_out = tl.load(DRESIDUAL_OUT + row * stride_dres_out_row + cols, mask=mask, other=0.0)
                else:
                    dres_out = 0.0
                _store_input_grads(DRESIDUAL, DX, seed, row, col_start, mask, dres_out, xhat, wdy, c1, c2,
                                   rstd, n_calls, dropout_threshold, dropout_scale, stride_dres_row,
                                   stride_dx_row, BLOCK_N, IS_RMS_NORM, HAS_DRESIDUAL_OUT, HAS_DROPOUT,
                                   STORE_DRESIDUAL)
            if HAS_WEIGHT:
                tl.store(DW_PARTIAL + pid * N + cols, dw, mask=cols < N)
            if HAS_BIAS:
                tl.store(DB_PARTIAL + pid * N + cols, db, mask=cols < N)
