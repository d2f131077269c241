"""FlashAttention-2 backward in Triton; deterministic unless the atomic dQ path is picked.

Three kernels: delta = rowsum(dO * O); dK/dV, one program per BLOCK_N keys of one kv head, walking every
query head of its GQA group and the query blocks that can see those keys (so GQA needs no reduction
afterwards); dQ, one program per BLOCK_M queries, walking the visible key blocks. The split recomputes
P and dP in the dQ kernel (7 matmuls instead of 5) in exchange for no atomics and no fp32 dQ buffer.
Where that measured slower (use_atomic_dq: dropout at head_dim <= 64) and determinism is not required, the
dK/dV kernel instead adds each tile's dS K into an fp32 dQ buffer with atomics (ATOMIC_DQ), FA2's way, and
the dQ kernel is not run. At head_dim 256 the dK/dV kernel runs twice, once for dV and once for dK (PART,
SPLIT_DKDV_CONFIGS): one fp32 accumulator per program lets its tiles grow from 32x32 to 64x128.
When the bias needs a gradient the dK/dV kernel also writes dS (fp32, full (B, H, Sq, Sk)), which is then
summed over the bias's broadcast dims.
Dropout regenerates the forward's keep-mask with the same `_dropout_keep` (one Philox call per 8 keys)
and the same host-computed threshold and 1 / P(keep) scale, so the gradients see exactly the forward's
dropped elements. The keep tile is cheap only in the (queries, keys) orientation, so with dropout the
dK/dV kernel computes its tiles in that orientation and transposes P and dS into the dots instead
(_dkdv_tile_queries_major: 1.1-1.3x its keys-major speed with p=0.1 on an H200); with a mask that varies
over queries or a bias gradient it stays keys-major and transposes the keep tile.
A query-broadcast (padding) mask is loaded once per key block, and the dK/dV kernel skips the query loops
of a key block it masks for every query (_key_block_mask): such keys contribute exactly zero. The dQ
kernel skips the key blocks outside the mask row's live keys, as the forward does (attention_fwd's
NARROW_PADDING_KEYS, MASK_SWITCH_HEAD_DIMS), and prefetches full mask tiles one block ahead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_backend._host_math import cdiv, next_power_of_2
from flash_backend._traced_launch import traced_launch
from flash_backend.kernels.attention_fwd import (
    LOG2E,
    _apply_mask,
    _dropout_keep,
    _grid_ids,
    _live_keys,
    _mask_args,
    _narrow_to_live_keys,
    _prefetch_mask,
    _visible,
    bh_grid,
    causal_group_ctas,
    head_dim_bucket,
    mask_is_query_broadcast,
    mask_key_ranges,
    mask_speed_flags,
)
from flash_backend.ops._eager import absent_pointer
from flash_backend.ops.attention import (
    DROPOUT_KEY_SPAN,
    DROPOUT_KEYS_PER_CALL,
    dropout_scale,
    dropout_threshold,
)

# head_dim bucket -> (BLOCK_M, BLOCK_N, num_warps, num_stages) for the dK/dV kernel and for the dQ kernel.
DKDV_CONFIGS = {64: (64, 64, 4, 2), 128: (64, 64, 4, 2), 256: (32, 32, 4, 2)}
DQ_CONFIGS = {64: (64, 64, 4, 2), 128: (64, 64, 4, 2), 256: (128, 64, 8, 1)}
# The dK/dV kernel when it also accumulates dQ with atomics: only where use_atomic_dq picks it. 3 stages:
# 1.07x at BERT's (32,12,512,64) with its padding row and 1.04x at GPT-2's causal (16,12,1024,64), both
# p=0.1 (bench_attention.py --e2e-configs, interleaved graph timing, logs/attention_e2e_configs_h200.log);
# never slower than 2 stages in the atomic-dQ sweep (1.00-1.02x, logs/attention_atomic_dq_h200.log).
ATOMIC_DKDV_CONFIGS = {64: (64, 64, 4, 3)}
# What one dK/dV launch computes. At head_dim 256 the two fp32 (BLOCK_N, 256) accumulators leave room for
# only 32 keys a program; dV alone (P, then P^T dO) and dK alone (P, dP, dS^T Q) each hold one, so the
# launcher runs the kernel twice with bigger tiles: 5 matmuls of work instead of 4, at a better rate.
DKDV_BOTH = tl.constexpr(0)
DV_ONLY = tl.constexpr(1)
DK_ONLY = tl.constexpr(2)
# head_dim bucket -> (dV-only config, dK-only config) for the buckets whose dK/dV work is split in two;
# with dropout the keep tile's registers favour 32 x 128 tiles (H200, (2,16,4096,256) p=0.1, 64 x 128 ->
# 32 x 128: causal 7.5 -> 5.5 ms, non-causal 10.1 -> 10.5 ms; the joint 32 x 32 kernel took 6.5 / 12.6 ms).
SPLIT_DKDV_CONFIGS = {256: ((64, 128, 8, 1), (64, 128, 8, 1))}
SPLIT_DKDV_DROPOUT_CONFIGS = {256: ((32, 128, 8, 2), (32, 128, 8, 2))}


def default_configs(head_dim: int, dropout_p: float, atomic_dq: bool):
    """(dK/dV config, dQ config) the backward runs; the dK/dV config is a (dV, dK) pair where it is split."""
    bucket = head_dim_bucket(head_dim)
    if atomic_dq and bucket in ATOMIC_DKDV_CONFIGS:
        return ATOMIC_DKDV_CONFIGS[bucket], DQ_CONFIGS[bucket]
    split_table = SPLIT_DKDV_DROPOUT_CONFIGS if dropout_p > 0.0 else SPLIT_DKDV_CONFIGS
    return split_table.get(bucket, DKDV_CONFIGS[bucket]), DQ_CONFIGS[bucket]


def use_atomic_dq(head_dim: int, dropout_p: float, mask_tiles: bool, deterministic: bool) -> bool:
    """Whether the backward accumulates dQ with atomics in the dK/dV kernel (5 matmuls, one kernel, not
    deterministic) rather than running the dQ kernel (7 matmuls, deterministic).

    Measured on the H200 (CUDA-graph replay, bf16, `bench/bench_attention.py --atomic-dq`,
    bench/logs/attention_atomic_dq_h200.log): atomics win with dropout at head_dim <= 64 (the dK/dV tile in
    the queries-major orientation, no mask): 1.1-1.2x (GPT-2's 16x12x1024 causal p=0.1: 426 -> 367 us).
    Without dropout the dQ kernel is as fast (ViT's 197 tokens) or 1.1-1.25x faster, and at head_dim 128
    with dropout 1.5x faster: the atomic kernel spills (sm_90 ptxas: its fp32 dQ tile and the per-element
    addresses of the atomics come on top of the dK/dV accumulators). head_dim 256 with dropout was within
    6 % either way, so it keeps the deterministic path.
    mask_tiles: a mask that varies over queries, or a bias gradient (dS stores): both keep the keys-major
    tile; a query-broadcast (padding) mask does not, and is applied as one row per key block."""
    return not deterministic and dropout_p > 0.0 and not mask_tiles and head_dim_bucket(head_dim) == 64


@triton.jit
def _attention_bwd_preprocess_kernel(
    OUT,
    DOUT,
    DELTA,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,  # out (B, H, Sq, D)
    stride_db,
    stride_dh,
    stride_dm,
    stride_dd,  # dout like out
    H,
    SEQ_Q,  # for varlen: B = 1 and SEQ_Q = total tokens
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BH_ON_X: tl.constexpr,  # (batch, head) pairs on the grid's first axis (attention_fwd.bh_grid)
):
    pid_m, pid_bh = _grid_ids(BH_ON_X, False, 0)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(
        OUT
        + b.to(tl.int64) * stride_ob
        + h * stride_oh
        + offs_m[:, None].to(tl.int64) * stride_om
        + offs_d[None, :] * stride_od,
        mask=mask,
        other=0.0,
    )
    do = tl.load(
        DOUT
        + b.to(tl.int64) * stride_db
        + h * stride_dh
        + offs_m[:, None].to(tl.int64) * stride_dm
        + offs_d[None, :] * stride_dd,
        mask=mask,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * SEQ_Q + offs_m, delta, mask=offs_m < SEQ_Q)


@triton.jit
def _add_dq_part(dqa_ptrs, dqa_mask, dq_part, MASK_DQ: tl.constexpr):
    """Accumulate one key block's share of dQ into the fp32 buffer. Relaxed: the adds need no ordering
    (the kernel's end is the only synchronisation), and the default acq_rel fences every add."""
    if MASK_DQ:
        tl.atomic_add(dqa_ptrs, dq_part, mask=dqa_mask, sem="relaxed")
    else:
        tl.atomic_add(dqa_ptrs, dq_part, sem="relaxed")


@triton.jit
def _key_block_mask(mask_row, stride_mn, offs_n, seqlen_k, MASK_IS_BOOL: tl.constexpr):
    """The keys offs_n of a query-broadcast mask row (for _apply_mask), and 1 when any of them is live
    (attention_fwd._live_keys), else 0."""
    in_seq = offs_n < seqlen_k
    m = tl.load(mask_row + offs_n * stride_mn, mask=in_seq, other=0)
    live = _live_keys(m, MASK_IS_BOOL) & in_seq
    if MASK_IS_BOOL:
        # once per block: applying the raw loaded row in every tile spilled more (sm_90 ptxas: 144 -> 240 B)
        m = live
    return m, tl.max(live.to(tl.int32), 0)


@triton.jit
def _dkdv_tile_queries_major(
    dk, dv, k, v, q, do, lse, delta, seed, key_mask, rows, offs_n, n0, seqlen_k, diag, window_left,
    window_right, qk_scale, dropout_threshold, dropout_scale, bh, dqa_ptrs, dqa_mask, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BOUNDARY: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    MASK_DQ: tl.constexpr,
    PART: tl.constexpr,
):
    """One (queries, keys) tile of dK/dV with dropout, computed in the forward's orientation.

    The keep tile is built in registers only in the (queries, keys) wgmma layout (see _dropout_keep); the
    keys-major loop needed it transposed, a shared-memory conversion of the Philox words per tile. Here
    P and dS are transposed instead, as the A operands of their two dots (FlashAttention-3 does the same).
    A mask here is a query-broadcast one: key_mask is its row for this key block (see _key_block_mask)."""
    qk = tl.dot(q, tl.trans(k)) * qk_scale
    if HAS_MASK:
        qk = _apply_mask(qk, key_mask[None, :], MASK_IS_BOOL)
    if BOUNDARY:
        visible = _visible(rows[:, None], offs_n[None, :], seqlen_k, diag, window_left, window_right,
                           HAS_LEFT, HAS_RIGHT)
        qk = tl.where(visible, qk, float("-inf"))
    p = tl.math.exp2(qk - lse[:, None] * 1.4426950408889634)
    keep = _dropout_keep(seed, rows, n0, seqlen_k, bh, dropout_threshold, BLOCK_M, BLOCK_N)
    if PART != DK_ONLY:
        pd = tl.where(keep, p * dropout_scale, 0.0)
        dv += tl.dot(tl.trans(pd.to(do.dtype)), do)
    if PART != DV_ONLY:
        dp = tl.dot(do, tl.trans(v))
        dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        if ATOMIC_DQ:
            _add_dq_part(dqa_ptrs, dqa_mask, tl.dot((ds * sm_scale).to(k.dtype), k), MASK_DQ)
    return dk, dv


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_ptrs,
    do_ptrs,
    mask_ptrs,
    ds_ptrs,
    lse_ptrs,
    delta_ptrs,
    dqa_ptrs,
    seed,
    key_mask,
    stride_qm,
    stride_dom,
    stride_mm,
    stride_dsm,
    stride_lm,
    offs_m,
    offs_n,
    offs_d,
    n0,  # first key of offs_n: a multiple of BLOCK_N, hence of 32, as _dropout_keep needs
    lo,
    hi,
    seqlen_q,
    seqlen_k,
    diag,
    window_left,
    window_right,
    qk_scale,
    dropout_threshold,
    dropout_scale,
    bh,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BOUNDARY: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_1D: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    STORE_DBIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PART: tl.constexpr,
):
    MASK_Q: tl.constexpr = BOUNDARY or HEAD_DIM != BLOCK_D
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=NUM_STAGES):
        rows = start_m + offs_m
        qmask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
        if MASK_Q:
            q = tl.load(q_ptrs + start_m * stride_qm, mask=qmask, other=0.0)
            do = tl.load(do_ptrs + start_m * stride_dom, mask=qmask, other=0.0)
        else:
            q = tl.load(q_ptrs + start_m * stride_qm)
            do = tl.load(do_ptrs + start_m * stride_dom)
        dqa_rows = dqa_ptrs + start_m * HEAD_DIM
        if BOUNDARY:
            lse = tl.load(lse_ptrs + rows * stride_lm, mask=rows < seqlen_q, other=float("inf"))
            delta = tl.load(delta_ptrs + rows, mask=rows < seqlen_q, other=0.0)
        else:
            lse = tl.load(lse_ptrs + rows * stride_lm)
            delta = tl.load(delta_ptrs + rows)
        # full mask tiles and dS stores stay keys-major (below)
        if HAS_DROPOUT and (MASK_1D or not HAS_MASK) and not STORE_DBIAS:
            dk, dv = _dkdv_tile_queries_major(
                dk, dv, k, v, q, do, lse, delta, seed, key_mask, rows, offs_n, n0, seqlen_k, diag,
                window_left, window_right, qk_scale, dropout_threshold, dropout_scale, bh, dqa_rows, qmask,
                sm_scale, BLOCK_M, BLOCK_N, BOUNDARY, HAS_MASK, MASK_IS_BOOL, HAS_LEFT, HAS_RIGHT, ATOMIC_DQ,
                MASK_Q, PART,
            )
        else:
            # transposed tiles: (BLOCK_N keys, BLOCK_M queries)
            qkT = tl.dot(k, tl.trans(q)) * qk_scale
            if HAS_MASK and MASK_1D:
                qkT = _apply_mask(qkT, key_mask[:, None], MASK_IS_BOOL)
            elif HAS_MASK:
                if BOUNDARY:
                    bias = tl.load(
                        mask_ptrs + start_m * stride_mm,
                        mask=(rows[None, :] < seqlen_q) & (offs_n[:, None] < seqlen_k),
                        other=0,
                    )
                else:
                    bias = tl.load(mask_ptrs + start_m * stride_mm)
                qkT = _apply_mask(qkT, bias, MASK_IS_BOOL)
            if BOUNDARY:
                visible = _visible(rows[None, :], offs_n[:, None], seqlen_k, diag, window_left, window_right,
                                   HAS_LEFT, HAS_RIGHT)
                qkT = tl.where(visible, qkT, float("-inf"))
            pT = tl.math.exp2(qkT - lse[None, :] * 1.4426950408889634)
            if HAS_DROPOUT:
                # the (queries, keys) tile the forward draws, transposed: the same bits on the same (i, j)
                keep = _dropout_keep(seed, rows, n0, seqlen_k, bh, dropout_threshold, BLOCK_M, BLOCK_N)
                keepT = tl.trans(keep)
            if PART != DK_ONLY:
                pdT = pT
                if HAS_DROPOUT:
                    pdT = tl.where(keepT, pT * dropout_scale, 0.0)
                dv += tl.dot(pdT.to(do.dtype), do)
            if PART != DV_ONLY:
                dpT = tl.dot(v, tl.trans(do))
                if HAS_DROPOUT:
                    dpT = tl.where(keepT, dpT * dropout_scale, 0.0)
                dsT = pT * (dpT - delta[None, :])
                if STORE_DBIAS:
                    tl.store(
                        ds_ptrs + start_m * stride_dsm,
                        dsT,
                        mask=(rows[None, :] < seqlen_q) & (offs_n[:, None] < seqlen_k),
                    )
                dk += tl.dot(dsT.to(q.dtype), q)
                if ATOMIC_DQ:
                    _add_dq_part(dqa_rows, qmask, tl.dot(tl.trans((dsT * sm_scale).to(k.dtype)), k), MASK_Q)
    return dk, dv


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q,
    K,
    V,
    MASK,
    SEED,
    DOUT,
    LSE,
    DELTA,
    DK,
    DV,
    DS,
    DQ_ACC,
    CU_Q,
    CU_K,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,  # q (B, Hq, Sq, D); varlen: stride_qb = 0
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,  # k (B, Hkv, Sk, D)
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,  # v
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,  # mask, 0 on broadcast dims
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,  # dout like q
    stride_lb,
    stride_lh,
    stride_lm,  # logsumexp (B, Hq, Sq); delta is contiguous (B*Hq, Sq)
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,  # dk like k
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,  # dv like v
    stride_dsb,
    stride_dsh,
    stride_dsm,
    stride_dsn,  # dS (B, Hq, Sq, Sk) fp32, only with STORE_DBIAS
    H,
    GROUP,
    SEQ_Q,
    SEQ_K,
    DELTA_SEQ,  # heads of q, Hq // Hkv, lengths, row length of DELTA
    qk_scale,
    sm_scale,
    dropout_threshold,  # drop when the 16-bit random half < this (round(p * 65536))
    dropout_scale,  # 1 / P(keep) of the quantised p
    window_left,
    window_right,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_1D: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    STORE_DBIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PART: tl.constexpr,  # DKDV_BOTH, or one of DV_ONLY / DK_ONLY when the launcher splits the work in two
    BH_ON_X: tl.constexpr,  # (batch, kv head) pairs on the grid's first axis (attention_fwd.bh_grid)
    GROUP_CTAS: tl.constexpr,  # the launch order's groups (attention_fwd._grid_ids, causal_group_ctas)
):
    pid_n, pid_bhk = _grid_ids(BH_ON_X, False, GROUP_CTAS)  # causal: the first key blocks are the heaviest
    # Inductor passes Python floats as fp64: keep the softmax in fp32
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    dropout_scale = tl.cast(dropout_scale, tl.float32)
    HKV = H // GROUP
    b = pid_bhk // HKV
    hk = pid_bhk % HKV
    # inlined rather than a helper: Inductor's mutation analysis counts pointers passed to calls as written
    if IS_VARLEN:
        q_start = tl.load(CU_Q + b)
        seqlen_q = tl.load(CU_Q + b + 1) - q_start
        k_start = tl.load(CU_K + b)
        seqlen_k = tl.load(CU_K + b + 1) - k_start
    else:
        q_start = 0
        seqlen_q = SEQ_Q
        k_start = 0
        seqlen_k = SEQ_K
    n0 = pid_n * BLOCK_N
    if n0 >= seqlen_k:
        return
    diag = seqlen_k - seqlen_q if BOTTOM_RIGHT else 0
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(
        K
        + b.to(tl.int64) * stride_kb
        + hk * stride_kh
        + (k_start + offs_n[:, None]).to(tl.int64) * stride_kn
        + offs_d[None, :] * stride_kd,
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V
        + b.to(tl.int64) * stride_vb
        + hk * stride_vh
        + (k_start + offs_n[:, None]).to(tl.int64) * stride_vn
        + offs_d[None, :] * stride_vd,
        mask=kv_mask,
        other=0.0,
    )
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)

    # Query blocks: [lo, full_lo) and [full_hi, hi) need element masks, [full_lo, full_hi) do not.
    # Query i sees key j when j - i - diag lies in [-left, right].
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = (seqlen_q // BLOCK_M) * BLOCK_M
    if HAS_RIGHT:
        lo = n0 - diag - window_right
        lo = lo + (0 - lo) * (lo < 0).to(tl.int32)
        lo = (lo // BLOCK_M) * BLOCK_M
        full_lo = n0 + BLOCK_N - 1 - diag - window_right
        full_lo = full_lo + (0 - full_lo) * (full_lo < 0).to(tl.int32)
        full_lo = tl.cdiv(full_lo, BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi_l = n0 + BLOCK_N - 1 - diag + window_left + 1
        hi = hi + (hi_l - hi) * (hi_l < hi).to(tl.int32)
        fh = ((n0 - diag + window_left + 1) // BLOCK_M) * BLOCK_M
        full_hi = full_hi + (fh - full_hi) * (fh < full_hi).to(tl.int32)
    if n0 + BLOCK_N > seqlen_k:
        full_hi = full_lo  # a partial key block needs element masks everywhere
    hi = hi + (lo - hi) * (hi < lo).to(tl.int32)
    full_lo = full_lo + (lo - full_lo) * (full_lo < lo).to(tl.int32)
    full_lo = full_lo + (hi - full_lo) * (full_lo > hi).to(tl.int32)
    full_hi = full_hi + (full_lo - full_hi) * (full_hi < full_lo).to(tl.int32)
    full_hi = full_hi + (hi - full_hi) * (full_hi > hi).to(tl.int32)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        q_ptrs = (
            Q
            + b.to(tl.int64) * stride_qb
            + h * stride_qh
            + (q_start + offs_m[:, None]).to(tl.int64) * stride_qm
            + offs_d[None, :] * stride_qd
        )
        do_ptrs = (
            DOUT
            + b.to(tl.int64) * stride_dob
            + h * stride_doh
            + (q_start + offs_m[:, None]).to(tl.int64) * stride_dom
            + offs_d[None, :] * stride_dod
        )
        mask_ptrs = MASK + b.to(tl.int64) * stride_mb + h * stride_mh + offs_n[:, None] * stride_mn
        if not MASK_1D:
            mask_ptrs = mask_ptrs + offs_m[None, :].to(tl.int64) * stride_mm
        ds_ptrs = (
            DS
            + b.to(tl.int64) * stride_dsb
            + h.to(tl.int64) * stride_dsh
            + offs_m[None, :].to(tl.int64) * stride_dsm
            + offs_n[:, None] * stride_dsn
        )
        lse_ptrs = LSE + b.to(tl.int64) * stride_lb + h * stride_lh + q_start * stride_lm
        # delta and the fp32 dQ buffer are (B*Hq, Sq) and (B*Hq, Sq, HEAD_DIM), varlen (Hq, total, ...)
        row0 = (b * H + h).to(tl.int64) * DELTA_SEQ + q_start
        if IS_VARLEN:
            row0 = h.to(tl.int64) * DELTA_SEQ + q_start
        delta_ptrs = DELTA + row0
        dqa_ptrs = DQ_ACC + (row0 + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
        key_mask = 0
        g_full_lo = full_lo
        g_full_hi = full_hi
        g_hi = hi
        if MASK_1D:
            # one load of this head's mask row for the whole block; a block of keys that every query ignores
            # has dK = dV = 0 and no share of dQ or dS: its query loops are skipped. A dead key (False, or an
            # additive -inf) has p = exp(-inf) = 0 for every query, so skipping is bitwise the same result;
            # a finite additive mask (finfo.min) is live. Padding masks end (or start) with such blocks.
            key_mask, live = _key_block_mask(MASK + b.to(tl.int64) * stride_mb + h * stride_mh, stride_mn,
                                             offs_n, seqlen_k, MASK_IS_BOOL)
            g_full_lo = lo + (full_lo - lo) * live
            g_full_hi = lo + (full_hi - lo) * live
            g_hi = lo + (hi - lo) * live
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_ptrs,
            do_ptrs,
            mask_ptrs,
            ds_ptrs,
            lse_ptrs,
            delta_ptrs,
            dqa_ptrs,
            seed,
            key_mask,
            stride_qm,
            stride_dom,
            stride_mm,
            stride_dsm,
            stride_lm,
            offs_m,
            offs_n,
            offs_d,
            n0,
            lo,
            g_full_lo,
            seqlen_q,
            seqlen_k,
            diag,
            window_left,
            window_right,
            qk_scale,
            dropout_threshold,
            dropout_scale,
            bh,
            sm_scale,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_M,
            BLOCK_N,
            True,
            HAS_MASK,
            MASK_1D,
            MASK_IS_BOOL,
            STORE_DBIAS,
            HAS_DROPOUT,
            HAS_LEFT,
            HAS_RIGHT,
            ATOMIC_DQ,
            1,
            PART,
        )
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_ptrs,
            do_ptrs,
            mask_ptrs,
            ds_ptrs,
            lse_ptrs,
            delta_ptrs,
            dqa_ptrs,
            seed,
            key_mask,
            stride_qm,
            stride_dom,
            stride_mm,
            stride_dsm,
            stride_lm,
            offs_m,
            offs_n,
            offs_d,
            n0,
            g_full_lo,
            g_full_hi,
            seqlen_q,
            seqlen_k,
            diag,
            window_left,
            window_right,
            qk_scale,
            dropout_threshold,
            dropout_scale,
            bh,
            sm_scale,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_M,
            BLOCK_N,
            False,
            HAS_MASK,
            MASK_1D,
            MASK_IS_BOOL,
            STORE_DBIAS,
            HAS_DROPOUT,
            HAS_LEFT,
            HAS_RIGHT,
            ATOMIC_DQ,
            NUM_STAGES,
            PART,
        )
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_ptrs,
            do_ptrs,
            mask_ptrs,
            ds_ptrs,
            lse_ptrs,
            delta_ptrs,
            dqa_ptrs,
            seed,
            key_mask,
            stride_qm,
            stride_dom,
            stride_mm,
            stride_dsm,
            stride_lm,
            offs_m,
            offs_n,
            offs_d,
            n0,
            g_full_hi,
            g_hi,
            seqlen_q,
            seqlen_k,
            diag,
            window_left,
            window_right,
            qk_scale,
            dropout_threshold,
            dropout_scale,
            bh,
            sm_scale,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_M,
            BLOCK_N,
            True,
            HAS_MASK,
            MASK_1D,
            MASK_IS_BOOL,
            STORE_DBIAS,
            HAS_DROPOUT,
            HAS_LEFT,
            HAS_RIGHT,
            ATOMIC_DQ,
            1,
            PART,
        )
    if PART != DV_ONLY:
        dk = dk * sm_scale
        tl.store(
            DK
            + b.to(tl.int64) * stride_dkb
            + hk * stride_dkh
            + (k_start + offs_n[:, None]).to(tl.int64) * stride_dkn
            + offs_d[None, :] * stride_dkd,
            dk.to(DK.dtype.element_ty),
            mask=kv_mask,
        )
    if PART != DK_ONLY:
        tl.store(
            DV
            + b.to(tl.int64) * stride_dvb
            + hk * stride_dvh
            + (k_start + offs_n[:, None]).to(tl.int64) * stride_dvn
            + offs_d[None, :] * stride_dvd,
            dv.to(DV.dtype.element_ty),
            mask=kv_mask,
        )


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse,
    delta,
    k_ptrs,
    v_ptrs,
    mask_ptrs,
    seed,
    stride_kn,
    stride_vn,
    stride_mn,
    offs_m,
    offs_n,
    offs_d,
    lo,
    hi,
    seqlen_k,
    diag,
    window_left,
    window_right,
    qk_scale,
    dropout_threshold,
    dropout_scale,
    bh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BOUNDARY: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH_MASK: tl.constexpr = False,
):
    # the next block's mask loaded one iteration ahead, as in attention_fwd._attention_fwd_inner
    PREFETCH: tl.constexpr = HAS_MASK and PREFETCH_MASK and not BOUNDARY
    if PREFETCH:
        bias_next = _prefetch_mask(mask_ptrs, lo, hi, stride_mn, offs_n)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        cols = start_n + offs_n
        if PREFETCH:
            bias = bias_next
            bias_next = _prefetch_mask(mask_ptrs, start_n + BLOCK_N, hi, stride_mn, offs_n)
        if BOUNDARY or HEAD_DIM != BLOCK_D:
            kv_mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(k_ptrs + start_n * stride_kn, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs + start_n * stride_vn, mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_ptrs + start_n * stride_kn)
            v = tl.load(v_ptrs + start_n * stride_vn)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        if HAS_MASK:
            if BOUNDARY:
                bias = tl.load(mask_ptrs + start_n * stride_mn, mask=cols[None, :] < seqlen_k, other=0)
            elif not PREFETCH:
                bias = tl.load(mask_ptrs + start_n * stride_mn)
            qk = _apply_mask(qk, bias, MASK_IS_BOOL)
        if BOUNDARY:
            visible = _visible(offs_m[:, None], cols[None, :], seqlen_k, diag, window_left, window_right,
                               HAS_LEFT, HAS_RIGHT)
            qk = tl.where(visible, qk, float("-inf"))
        p = tl.math.exp2(qk - lse[:, None])
        dp = tl.dot(do, tl.trans(v))
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, offs_m, start_n, seqlen_k, bh, dropout_threshold, BLOCK_M, BLOCK_N)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _dq_blocks(
    dq, q, do, lse, delta, k_ptrs, v_ptrs, mask_ptrs, seed, stride_kn, stride_vn, stride_mn, offs_m, offs_n,
    offs_d, lo, full_lo, full_hi, hi, seqlen_k, diag, window_left, window_right, qk_scale,
    dropout_threshold, dropout_scale, bh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREFETCH_MASK: tl.constexpr = False,
):
    """All key blocks of a query block, as attention_fwd._attention_fwd_blocks."""
    dq = _dq_inner(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, mask_ptrs, seed, stride_kn, stride_vn, stride_mn, offs_m,
        offs_n, offs_d, lo, full_lo, seqlen_k, diag, window_left, window_right, qk_scale,
        dropout_threshold, dropout_scale, bh, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True, HAS_MASK,
        MASK_IS_BOOL, HAS_DROPOUT, HAS_LEFT, HAS_RIGHT, 1,
    )
    dq = _dq_inner(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, mask_ptrs, seed, stride_kn, stride_vn, stride_mn, offs_m,
        offs_n, offs_d, full_lo, full_hi, seqlen_k, diag, window_left, window_right, qk_scale,
        dropout_threshold, dropout_scale, bh, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, False, HAS_MASK,
        MASK_IS_BOOL, HAS_DROPOUT, HAS_LEFT, HAS_RIGHT, NUM_STAGES, PREFETCH_MASK,
    )
    return _dq_inner(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, mask_ptrs, seed, stride_kn, stride_vn, stride_mn, offs_m,
        offs_n, offs_d, full_hi, hi, seqlen_k, diag, window_left, window_right, qk_scale,
        dropout_threshold, dropout_scale, bh, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True, HAS_MASK,
        MASK_IS_BOOL, HAS_DROPOUT, HAS_LEFT, HAS_RIGHT, 1,
    )


@triton.jit
def _attention_bwd_dq_kernel(
    Q,
    K,
    V,
    MASK,
    SEED,
    DOUT,
    LSE,
    DELTA,
    DQ,
    CU_Q,
    CU_K,
    KEY_RANGE,  # (attention_fwd.mask_key_ranges) or a dummy without NARROW_KEYS
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,  # q (B, Hq, Sq, D); varlen: stride_qb = 0
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,  # k (B, Hkv, Sk, D)
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,  # v
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,  # mask, 0 on broadcast dims
    stride_rb,
    stride_rh,  # KEY_RANGE rows of a batch / head
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,  # dout like q
    stride_lb,
    stride_lh,
    stride_lm,  # logsumexp; delta is contiguous (B*Hq, DELTA_SEQ)
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_dqd,  # dq like q
    H,
    GROUP,
    SEQ_Q,
    SEQ_K,
    DELTA_SEQ,
    qk_scale,
    sm_scale,
    dropout_threshold,  # drop when the 16-bit random half < this (round(p * 65536))
    dropout_scale,  # 1 / P(keep) of the quantised p
    window_left,
    window_right,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_1D: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    NARROW_KEYS: tl.constexpr,
    PREFETCH_MASK: tl.constexpr,
    BH_ON_X: tl.constexpr,  # (batch, head) pairs on the grid's first axis (attention_fwd.bh_grid)
    GROUP_CTAS: tl.constexpr,  # the launch order's groups (attention_fwd._grid_ids, causal_group_ctas)
):
    pid_m, pid_bh = _grid_ids(BH_ON_X, True, GROUP_CTAS)
    # Inductor passes Python floats as fp64: keep the softmax in fp32
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    dropout_scale = tl.cast(dropout_scale, tl.float32)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    # inlined rather than a helper: Inductor's mutation analysis counts pointers passed to calls as written
    if IS_VARLEN:
        q_start = tl.load(CU_Q + b)
        seqlen_q = tl.load(CU_Q + b + 1) - q_start
        k_start = tl.load(CU_K + b)
        seqlen_k = tl.load(CU_K + b + 1) - k_start
    else:
        q_start = 0
        seqlen_q = SEQ_Q
        k_start = 0
        seqlen_k = SEQ_K
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    diag = seqlen_k - seqlen_q if BOTTOM_RIGHT else 0
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    qmask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(
        Q
        + b.to(tl.int64) * stride_qb
        + h * stride_qh
        + (q_start + offs_m[:, None]).to(tl.int64) * stride_qm
        + offs_d[None, :] * stride_qd,
        mask=qmask,
        other=0.0,
    )
    do = tl.load(
        DOUT
        + b.to(tl.int64) * stride_dob
        + h * stride_doh
        + (q_start + offs_m[:, None]).to(tl.int64) * stride_dom
        + offs_d[None, :] * stride_dod,
        mask=qmask,
        other=0.0,
    )
    lse = (
        tl.load(
            LSE + b.to(tl.int64) * stride_lb + h * stride_lh + (q_start + offs_m) * stride_lm,
            mask=offs_m < seqlen_q,
            other=float("inf"),
        )
        * 1.4426950408889634
    )
    if IS_VARLEN:
        delta = tl.load(
            DELTA + h.to(tl.int64) * DELTA_SEQ + q_start + offs_m, mask=offs_m < seqlen_q, other=0.0
        )
    else:
        delta = tl.load(DELTA + pid_bh.to(tl.int64) * DELTA_SEQ + offs_m, mask=offs_m < seqlen_q, other=0.0)
    k_ptrs = (
        K
        + b.to(tl.int64) * stride_kb
        + hk * stride_kh
        + (k_start + offs_n[:, None]).to(tl.int64) * stride_kn
        + offs_d[None, :] * stride_kd
    )
    v_ptrs = (
        V
        + b.to(tl.int64) * stride_vb
        + hk * stride_vh
        + (k_start + offs_n[:, None]).to(tl.int64) * stride_vn
        + offs_d[None, :] * stride_vd
    )
    mask_ptrs = MASK + b.to(tl.int64) * stride_mb + h * stride_mh + offs_n[None, :] * stride_mn
    if not MASK_1D:  # a mask broadcast over query rows (padding) is loaded as one row per key block
        mask_ptrs = mask_ptrs + offs_m[:, None].to(tl.int64) * stride_mm
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)

    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = m0 + diag - window_left
        lo = lo + (0 - lo) * (lo < 0).to(tl.int32)
        lo = (lo // BLOCK_N) * BLOCK_N
        full_lo = m0 + BLOCK_M - 1 + diag - window_left
        full_lo = full_lo + (0 - full_lo) * (full_lo < 0).to(tl.int32)
        full_lo = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi_r = m0 + BLOCK_M - 1 + diag + window_right + 1
        hi = hi + (hi_r - hi) * (hi_r < hi).to(tl.int32)
        fh = ((m0 + diag + window_right + 1) // BLOCK_N) * BLOCK_N
        full_hi = full_hi + (fh - full_hi) * (fh < full_hi).to(tl.int32)
    if NARROW_KEYS:
        # loaded here, not in the helper: Inductor's mutation analysis takes pointers passed to calls
        # for written ones
        key_range = KEY_RANGE + b * stride_rb + h * stride_rh
        lo, hi = _narrow_to_live_keys(tl.load(key_range), tl.load(key_range + 1), lo, hi, BLOCK_N)
    hi = hi + (lo - hi) * (hi < lo).to(tl.int32)
    full_lo = full_lo + (lo - full_lo) * (full_lo < lo).to(tl.int32)
    full_lo = full_lo + (hi - full_lo) * (full_lo > hi).to(tl.int32)
    full_hi = full_hi + (full_lo - full_hi) * (full_hi < full_lo).to(tl.int32)
    full_hi = full_hi + (hi - full_hi) * (full_hi > hi).to(tl.int32)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_blocks(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, mask_ptrs, seed, stride_kn, stride_vn, stride_mn, offs_m,
        offs_n, offs_d, lo, full_lo, full_hi, hi, seqlen_k, diag, window_left, window_right, qk_scale,
        dropout_threshold, dropout_scale, pid_bh, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, MASK_IS_BOOL,
        HAS_DROPOUT, HAS_LEFT, HAS_RIGHT, NUM_STAGES, PREFETCH_MASK,
    )
    dq = dq * sm_scale
    tl.store(
        DQ
        + b.to(tl.int64) * stride_dqb
        + h * stride_dqh
        + (q_start + offs_m[:, None]).to(tl.int64) * stride_dqm
        + offs_d[None, :] * stride_dqd,
        dq.to(DQ.dtype.element_ty),
        mask=qmask,
    )


def _launch_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    attn_mask,
    seed,
    dropout_p,
    scale,
    window_left,
    window_right,
    bottom_right,
    dq,
    dk,
    dv,
    ds,
    views,
    B,
    H,
    Hkv,
    seq_q,
    seq_k,
    max_q,
    max_k,
    cu_q,
    cu_k,
    atomic_dq,
    config,
    launch,
):
    q_s, k_s, v_s, o_s, do_s, l_s, dq_s, dk_s, dv_s = views
    D = q.shape[-1]
    block_d = max(next_power_of_2(D), 16)
    # config (sweeps): (dK/dV config, dQ config); a dK/dV config that is a pair of configs means split
    dkdv_cfg, dq_cfg = config or default_configs(D, dropout_p, atomic_dq)
    # plain ints for PART: Inductor writes the launch's constexpr arguments into its generated code
    if isinstance(dkdv_cfg[0], tuple):
        dkdv_parts = [(DV_ONLY.value, dkdv_cfg[0]), (DK_ONLY.value, dkdv_cfg[1])]
    else:
        dkdv_parts = [(DKDV_BOTH.value, dkdv_cfg)]
    block_ns = [cfg[1] for _, cfg in dkdv_parts] + [dq_cfg[1]]
    if dropout_p > 0.0 and any(bn % DROPOUT_KEY_SPAN for bn in block_ns):
        raise ValueError(
            f"attention backward: BLOCK_N must be a multiple of {DROPOUT_KEY_SPAN} with dropout (a Philox "
            f"call serves {DROPOUT_KEYS_PER_CALL} keys spread over {DROPOUT_KEY_SPAN}), got {block_ns[:-1]} "
            f"(dK/dV) and {dq_cfg[1]} (dQ)"
        )
    varlen = cu_q is not None
    delta_rows, delta_seq = (H, q.shape[0]) if varlen else (B * H, seq_q)
    delta = torch.empty((delta_rows, delta_seq), dtype=torch.float32, device=q.device)
    pre_b, pre_h = (1, H) if varlen else (B, H)
    pre_grid, pre_swap = bh_grid(cdiv(delta_seq, 64), pre_b * pre_h)
    launch(_attention_bwd_preprocess_kernel)[pre_grid](
        out, dout, delta, *o_s, *do_s, H, delta_seq, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=64,
        BH_ON_X=pre_swap, num_warps=4
    )
    dummy = absent_pointer(q, launch)  # stands for absent optional pointers; never read
    mask_t, m_s, has_mask, mask_is_bool = _mask_args(attn_mask, dummy)
    common = dict(
        HAS_MASK=has_mask,
        MASK_1D=mask_is_query_broadcast(attn_mask),
        MASK_IS_BOOL=mask_is_bool,
        HAS_DROPOUT=dropout_p > 0.0,
        IS_VARLEN=varlen,
        BOTTOM_RIGHT=bottom_right,
        HAS_LEFT=window_left >= 0,
        HAS_RIGHT=window_right >= 0,
        HEAD_DIM=D,
        BLOCK_D=block_d,
    )
    seed_t = seed if seed is not None else dummy
    cu_q_t = cu_q if cu_q is not None else dummy
    cu_k_t = cu_k if cu_k is not None else dummy
    ds_t, ds_s = (ds, ds.stride()) if ds is not None else (dummy, (0, 0, 0, 0))
    dq_acc = dummy
    if atomic_dq:
        dq_acc = torch.zeros((delta_rows, delta_seq, D), dtype=torch.float32, device=q.device)
    dkdv_args = (
        q,
        k,
        v,
        mask_t,
        seed_t,
        dout,
        lse,
        delta,
        dk,
        dv,
        ds_t,
        dq_acc,
        cu_q_t,
        cu_k_t,
        *q_s,
        *k_s,
        *v_s,
        *m_s,
        *do_s,
        *l_s,
        *dk_s,
        *dv_s,
        *ds_s,
        H,
        H // Hkv,
        seq_q,
        seq_k,
        delta_seq,
        scale * LOG2E,
        scale,
        dropout_threshold(dropout_p),
        dropout_scale(dropout_p),
        window_left,
        window_right,
    )
    for part, (bm, bn, warps, stages) in dkdv_parts:
        grid, swap = bh_grid(cdiv(max_k, bn), B * Hkv)
        launch(_attention_bwd_dkdv_kernel)[grid](
            *dkdv_args,
            BLOCK_M=bm,
            BLOCK_N=bn,
            STORE_DBIAS=ds is not None,
            ATOMIC_DQ=atomic_dq,
            NUM_STAGES=stages,
            PART=part,
            BH_ON_X=swap,
            GROUP_CTAS=causal_group_ctas(q.device, window_right == 0, swap),
            num_warps=warps,
            num_stages=stages,
            **common,
        )
    if atomic_dq:
        # (B*Hq, Sq, D) -> dq's (B, Hq, Sq, D); varlen (Hq, total, D) -> (total, Hq, D)
        dq.copy_(dq_acc.transpose(0, 1) if varlen else dq_acc.view(B, H, seq_q, D))
        return
    narrow, prefetch = mask_speed_flags(attn_mask, D)
    key_ranges, r_s = dummy, (0, 0)
    if narrow:
        key_ranges, r_s = mask_key_ranges(attn_mask, m_s, seq_k, mask_is_bool, launch)
    bm, bn, warps, stages = dq_cfg
    grid, swap = bh_grid(cdiv(max_q, bm), B * H)
    launch(_attention_bwd_dq_kernel)[grid](
        q,
        k,
        v,
        mask_t,
        seed_t,
        dout,
        lse,
        delta,
        dq,
        cu_q_t,
        cu_k_t,
        key_ranges,
        *q_s,
        *k_s,
        *v_s,
        *m_s,
        *r_s,
        *do_s,
        *l_s,
        *dq_s,
        H,
        H // Hkv,
        seq_q,
        seq_k,
        delta_seq,
        scale * LOG2E,
        scale,
        dropout_threshold(dropout_p),
        dropout_scale(dropout_p),
        window_left,
        window_right,
        BLOCK_M=bm,
        BLOCK_N=bn,
        NUM_STAGES=stages,
        NARROW_KEYS=narrow,
        PREFETCH_MASK=prefetch,
        BH_ON_X=swap,
        GROUP_CTAS=causal_group_ctas(q.device, window_right == 0, swap),
        num_warps=warps,
        num_stages=stages,
        **common,
    )


def attention_backward_launch(
    dout,
    q,
    k,
    v,
    out,
    lse,
    attn_mask,
    seed,
    dropout_p,
    scale,
    window_left,
    window_right,
    bottom_right,
    dq,
    dk,
    dv,
    dbias,
    *,
    atomic_dq=False,
    config=None,
    launch=traced_launch,
):
    """Fill dq, dk, dv (and dbias, attn_mask's shape, when given) for (B, H, S, D) inputs of any strides.

    atomic_dq=True accumulates dQ with fp32 atomics inside the dK/dV kernel instead of running the dQ kernel
    (see use_atomic_dq for when that is faster; it is not deterministic)."""
    B, H, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    ds = None
    if dbias is not None:
        ds = torch.zeros((B, H, Sq, Sk), dtype=torch.float32, device=q.device)
    views = tuple(t.stride() for t in (q, k, v, out, dout, lse, dq, dk, dv))
    _launch_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        attn_mask,
        seed,
        dropout_p,
        scale,
        window_left,
        window_right,
        bottom_right,
        dq,
        dk,
        dv,
        ds,
        views,
        B,
        H,
        Hkv,
        Sq,
        Sk,
        Sq,
        Sk,
        None,
        None,
        atomic_dq,
        config,
        launch,
    )
    if dbias is not None:
        dims = [d for d in range(4) if attn_mask.shape[d] == 1 and ds.shape[d] != 1]
        dbias.copy_(ds.sum(dim=dims, keepdim=True) if dims else ds)


def attention_varlen_backward_launch(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_q,
    cu_k,
    max_seqlen_q,
    max_seqlen_k,
    seed,
    dropout_p,
    scale,
    window_left,
    window_right,
    bottom_right,
    dq,
    dk,
    dv,
    *,
    atomic_dq=False,
    config=None,
    launch=traced_launch,
):
    _, H, _ = q.shape
    Hkv = k.shape[1]
    B = cu_q.shape[0] - 1

    def bhsd(t):
        return (0, t.stride(1), t.stride(0), t.stride(2))

    views = (
        bhsd(q),
        bhsd(k),
        bhsd(v),
        bhsd(out),
        bhsd(dout),
        (0, lse.stride(0), lse.stride(1)),
        bhsd(dq),
        bhsd(dk),
        bhsd(dv),
    )
    _launch_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        None,
        seed,
        dropout_p,
        scale,
        window_left,
        window_right,
        bottom_right,
        dq,
        dk,
        dv,
        None,
        views,
        B,
        H,
        Hkv,
        0,
        0,
        max_seqlen_q,
        max_seqlen_k,
        cu_q,
        cu_k,
        atomic_dq,
        config,
        launch,
    )
