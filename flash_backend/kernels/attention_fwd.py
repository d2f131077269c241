"""FlashAttention-2 forward in Triton: one program per BLOCK_M query rows of one (batch, head).

The key range of a query block is split into blocks that need no element mask (fully visible, fully in
bounds: the fast loop, no `where`) and the few boundary blocks around the causal diagonal / window edges /
sequence end (the masked loop). Blocks entirely outside the window are never visited. Softmax runs in
base 2 with log2(e) folded into the scale. Strides are passed for every tensor, so (B, S, H, D)-transposed
inputs, broadcast masks (stride 0) and packed varlen sequences (per-sequence offsets from cu_seqlens) run
through the same kernel without copies. With a padding mask (one row per batch/head) the key range also
drops the blocks outside the row's live keys (_mask_key_range_kernel; switches and their measurements at
NARROW_PADDING_KEYS).

Dropout draws one Philox-4x32 call per 8 consecutive keys of a query row and splits its 4 words into 8
16-bit halves (`_dropout_keep`; the scheme is in flash_backend/ops/attention.py, Conventions). A call
per key, as before, made Philox's integer multiplies the bottleneck: ~7x the no-dropout kernel time at
GPT-2 shapes on an H200. p is quantised to 1/65536 and kept values are scaled by 1 / P(keep) of that
quantised p (both computed on the host), so the output stays unbiased.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import statically_known_true

from flash_backend._device import sm_count
from flash_backend._host_math import cdiv, next_power_of_2
from flash_backend._traced_launch import traced_launch
from flash_backend.ops._eager import absent_pointer
from flash_backend.ops.attention import (
    DROPOUT_KEY_SPAN,
    DROPOUT_KEYS_PER_CALL,
    dropout_scale,
    dropout_threshold,
)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# CUDA's limit on a grid's second (and third) axis; the first goes to 2**31 - 1
MAX_GRID_Y = 65535


def bh_grid(blocks, rows):
    """(grid, BH_ON_X) of a kernel over `blocks` query (or key) blocks of `rows` (batch, head) pairs.

    rows go on the grid's second axis, whose limit is 65535: a large batch of short sequences passes it
    (B * H = 8192 x 12 for ViT-base inference). Then the axes swap and the kernel reads them swapped
    (its BH_ON_X constexpr); launched unswapped, CUDA refuses the grid ("invalid argument")."""
    if rows <= MAX_GRID_Y:
        return (blocks, rows), False
    if blocks > MAX_GRID_Y:
        raise ValueError(f"flash_attention: {rows} (batch, head) pairs with {blocks} blocks of queries or "
                         f"keys each: one of the two must be at most {MAX_GRID_Y} (CUDA's grid limit)")
    return (rows, blocks), True

# (head_dim bucket, causal) -> (BLOCK_M, BLOCK_N, num_warps, num_stages); tuned on an H200 (bench --sweep).
# Causal at head_dim 64: 64x64 with 4 warps, GPU time (graph replay) against 128x128 with 8 warps: 1.32x at
# S=1024 (GPT-2's 16x12x1024: 136 -> 103 us; with dropout 177 -> 148), 1.21x at 2048, 1.05x at 8192
# (bench/logs/attention_fwd_causal_configs_h200.log); smaller blocks waste less of the diagonal.
FWD_CONFIGS = {
    (64, False): (128, 64, 8, 3),
    (64, True): (64, 64, 4, 3),
    (128, False): (128, 128, 8, 3),
    (128, True): (128, 128, 8, 3),
    (256, False): (128, 64, 8, 2),
    (256, True): (128, 64, 8, 2),
}


# Short keys at head_dim <= 64 without causal masking, a mask or dropout (ViT-base's 197 tokens, CLIP
# ViT-L/14's 257): 32-key blocks in four warps. The forward alone against FWD_CONFIGS' tile at 64,12,S
# (CUDA graphs in interleaved rounds, bench/logs/attention_fwd_small_configs_s35_h200.log): 1.08x at 64
# and 128 keys, 1.13x at 197 (224 keys in 32-key blocks against 256 in 64-key ones), 0.99x at 256, 1.09x
# at 257 (288 against 320), 0.98x at 320, 0.97x at 384, 0.94x at 32,12,512, 0.90x at 16,16,1024. So: up
# to SHORT_KEYS_MAX keys, and past 256 while the last 64-key block would be at most half full.
SHORT_KEYS_FWD_CONFIG = (128, 32, 4, 3)
SHORT_KEYS_MAX = 224
SHORT_KEYS_HALF_BLOCK_RANGE = (257, 288)


def short_keys_tile(head_dim, windowed: bool, has_mask: bool, has_dropout: bool, seq_k) -> bool:
    """Whether a forward runs SHORT_KEYS_FWD_CONFIG (windowed: causal or a sliding window). seq_k may be a
    SymInt in a traced graph: only a length known to be in range without a guard counts (dynamic shapes keep
    FWD_CONFIGS, and never recompile for it)."""
    if windowed or has_mask or has_dropout or head_dim_bucket(head_dim) != 64:
        return False
    lo, hi = SHORT_KEYS_HALF_BLOCK_RANGE
    if isinstance(seq_k, int):
        return seq_k <= SHORT_KEYS_MAX or lo <= seq_k <= hi
    return statically_known_true(seq_k <= SHORT_KEYS_MAX) or (statically_known_true(seq_k >= lo)
                                                              and statically_known_true(seq_k <= hi))


def head_dim_bucket(d: int) -> int:
    return 64 if d <= 64 else (128 if d <= 128 else 256)


def fwd_config(head_dim: int, causal: bool, has_mask: bool = False, override=None, has_dropout: bool = False,
               narrow: bool = False, short_keys: bool = False):
    if override:
        return override
    if short_keys:  # short_keys_tile
        return SHORT_KEYS_FWD_CONFIG
    key = (head_dim_bucket(head_dim), causal)
    # a key range narrowed to a padding mask's live keys has its own tiles (see NARROW_PADDING_KEYS)
    table = PADDING_FWD_CONFIGS if narrow and key in PADDING_FWD_CONFIGS else FWD_CONFIGS
    block_m, block_n, num_warps, num_stages = table[key]
    if has_mask:  # mask tiles are pipelined too: keep shared memory under the 227 KiB of an H100/H200
        block_n, num_stages = min(block_n, 64), min(num_stages, 2)
        block_m = 64 if head_dim > 128 else block_m
    if has_dropout and head_dim > 64:
        # The keep tile is rebuilt from [BLOCK_M, BLOCK_N / 8] Philox words through a shared-memory layout
        # conversion; at D=128 with 3 stages of K/V that needed 240 KiB (H200: "out of resource").
        num_stages = min(num_stages, 2)
    return block_m, block_n, num_warps, num_stages


@triton.jit
def _grid_ids(BH_ON_X: tl.constexpr, HEAVIEST_FIRST: tl.constexpr, GROUP_CTAS: tl.constexpr):
    """(block, pair): this program's query (or key) block and (batch, head) pair, on the grid bh_grid laid
    out. HEAVIEST_FIRST numbers the blocks from the last (causal: the query blocks with the most visible keys
    run first). GROUP_CTAS > 0 (causal_group_ctas: causal launches, where a pair's blocks differ in work): the
    launch order goes by groups of pairs of about GROUP_CTAS programs, and within a group block by block
    across its pairs, so that the heavy blocks of the last pairs do not start at the end of the launch and
    the tail is light programs (the Gluon kernels' attention_fwd_hopper._heaviest_first). Not with BH_ON_X."""
    if BH_ON_X:
        block = tl.program_id(1)
        n_blocks = tl.num_programs(1)
        pair = tl.program_id(0)
    elif GROUP_CTAS > 0:
        n_blocks = tl.num_programs(0)
        pairs = tl.num_programs(1)
        group = tl.maximum(1, tl.minimum(pairs, (GROUP_CTAS + n_blocks - 1) // n_blocks))
        linear = tl.program_id(1) * n_blocks + tl.program_id(0)
        first_pair = linear // (group * n_blocks) * group
        group_pairs = tl.minimum(group, pairs - first_pair)  # the last group may be short
        in_group = linear - first_pair * n_blocks
        block = in_group // group_pairs
        pair = first_pair + in_group - block * group_pairs
    else:
        block = tl.program_id(0)
        n_blocks = tl.num_programs(0)
        pair = tl.program_id(1)
    if HEAVIEST_FIRST:
        block = n_blocks - 1 - block
    return block, pair


# Causal launches of the Triton kernels order their programs by groups of about this many waves (one wave:
# a program an SM; several programs of these kernels share an SM). Kernels alone against the plain order
# (bench/probes/attention_causal_order_probe.py part 3, bench/logs/attention_causal_order_probe_triton_s28_
# h200.log): forward / backward 1.04x / 1.04x at 8,16,2048,64, 1.02x / 1.02x at 16,12,1024,64 (GPT-2),
# 1.14x / 1.11x at 4,16,1024,128, flat at 16,16,1024,64; 2 waves lost 2-3 % at head_dim 64, 16 lost at 1024.
CAUSAL_GROUP_WAVES = 8


def causal_group_ctas(device: torch.device, causal: bool, bh_on_x: bool) -> int:
    """GROUP_CTAS of _grid_ids: 0 (the plain order) unless a causal launch on a GPU, grid not swapped."""
    if not causal or bh_on_x or device.type != "cuda":
        return 0
    return CAUSAL_GROUP_WAVES * sm_count(device)


@triton.jit
def _dropout_keep(
    seed, offs_m, col_start, seqlen_k, bh, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """[BLOCK_M, BLOCK_N] keep-mask of queries offs_m and keys col_start + arange(BLOCK_N), as the
    reference's dropout_keep (ops/attention.py, Conventions): key j = 32a + 8b + 2c + e takes half e of
    word b of Philox call 4a + c of its row. col_start must be a multiple of 32: callers pass a multiple of
    BLOCK_N, itself a multiple of 32.

    The reshape/permute below only renames which register holds which key: in a wgmma score tile a
    thread holds keys 2c + {0, 1} of every 8-key block, i.e. the 8 keys of its calls, so the compiler
    keeps the Philox words in the score tile's own layout (sm_90 TTGIR: no convert_layout beyond the
    no-dropout kernel's in the forward and dQ kernels)."""
    tl.static_assert(BLOCK_N % 32 == 0, "dropout spreads a Philox call over 32 keys: BLOCK_N % 32 == 0")
    SPANS: tl.constexpr = BLOCK_N // 32
    calls = tl.reshape((col_start // 32 + tl.arange(0, SPANS))[:, None] * 4 + tl.arange(0, 4)[None, :],
                       (BLOCK_N // 8,))
    c0 = (offs_m[:, None] * (tl.cdiv(seqlen_k, 32) * 4) + calls[None, :]).to(tl.uint32)
    zero = tl.zeros_like(c0)
    # 7 rounds: DROPOUT_PHILOX_ROUNDS of the reference (a literal: n_rounds must be a compile-time constant).
    r0, r1, r2, r3 = tl.random.philox(seed, c0, zero + bh, zero, zero, n_rounds=7)
    # join appends a minor axis: [m, call, i, o] holds word 2i + o, so the flattened minor axis is b.
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_M, SPANS, 4, 4))  # [m, a, c, b]
    halves = tl.join(words & 0xFFFF, words >> 16)  # [m, a, c, b, e]
    halves = tl.reshape(tl.permute(halves, (0, 1, 3, 2, 4)), (BLOCK_M, BLOCK_N))  # key 32a + 8b + 2c + e
    return halves.to(tl.int32) >= threshold  # halves < 2**16: the cast keeps the value


@triton.jit
def _apply_mask(scores, bias, MASK_IS_BOOL: tl.constexpr):
    """Scores (base-2 units) with an attn_mask tile or row applied, bias already shaped to broadcast into
    them: a bool mask keeps True, an additive one is added (converted to log2 units)."""
    if MASK_IS_BOOL:
        return tl.where(bias, scores, float("-inf"))
    return scores + bias.to(tl.float32) * 1.4426950408889634


@triton.jit
def _visible(queries, keys, seqlen_k, diag, window_left, window_right, HAS_LEFT: tl.constexpr,
             HAS_RIGHT: tl.constexpr):
    """Which (query, key) pairs of a tile may attend (module Conventions): keys inside the sequence and
    inside the window around query + diag. queries and keys are index tensors already shaped to broadcast
    into the tile, in whichever orientation the caller's tile has."""
    visible = keys < seqlen_k
    rel = keys - (queries + diag)
    if HAS_RIGHT:
        visible = visible & (rel <= window_right)
    if HAS_LEFT:
        visible = visible & (rel >= -window_left)
    return visible


@triton.jit
def _live_keys(m, MASK_IS_BOOL: tl.constexpr):
    """Which entries of a loaded mask row leave their key visible: True, or an additive value that
    _apply_mask does not turn into -inf (-inf itself, and finfo.min of bf16 / fp32, overflow to -inf once
    scaled to base 2 in fp32, so they mask as -inf does)."""
    if MASK_IS_BOOL:
        return m != 0
    return m.to(tl.float32) * 1.4426950408889634 != float("-inf")


@triton.jit
def _prefetch_mask(mask_ptrs, start_n, hi, stride_mn, offs_n):
    """The mask row (or tile) of the full key block at start_n, or zeros when start_n >= hi (the load
    after a loop's last block, or an empty loop): never read then."""
    return tl.load(mask_ptrs + start_n * stride_mn, mask=(start_n + offs_n[None, :]) < hi, other=0)


# Keys of a query-broadcast mask row read per load by _mask_key_range_kernel.
KEY_RANGE_CHUNK = 1024


@triton.jit
def _mask_key_range_kernel(MASK, RANGE, BIAS, PURE, stride_mb, stride_mh, stride_mn, HM, seqlen_k, bias_len,
                           MASK_IS_BOOL: tl.constexpr, CHUNK: tl.constexpr, WRITE_BIAS: tl.constexpr):
    """For each row of a query-broadcast (B, H, 1, Sk) mask: RANGE[row] = (lo, hi), its first live key and
    its last live key + 1 ((0, 0) when none is). A dead key is False, or an additive value that is -inf
    once scaled to base 2 in fp32, as _apply_mask computes it (-inf, or bf16's / fp32's finfo.min; fp16's
    finfo.min stays finite, so live).

    Why: a dead key's score is -inf for every query, so p = 0 and the running max is left alone: key blocks
    outside [lo, hi) add exactly nothing to the output, the logsumexp or any gradient, and the forward and
    dQ kernels skip them (_narrow_to_live_keys; the dK/dV kernel checks its own key block). Padding masks
    (right padding as BERT's, left padding as generation's) are such runs. One program per mask row, once
    per launch: scanning the row in every attention program cost more than the blocks it skipped (+45 %
    forward time at BERT's shape on an H200).

    WRITE_BIAS: also BIAS[row, :bias_len] = the row as _apply_mask adds it (fp32, base 2: 0 / -inf for a
    bool mask, the value times log2(e) for an additive one), -inf past seqlen_k: what the Gluon kernels
    (kernels/attention_fwd_hopper.py) add to their scores. Contiguous and padded to whole key blocks, it
    loads there at constant offsets without bounds checks: reading the mask itself (a pointer and a
    predicate per key a thread) spilled ~950 bytes in the three-warpgroup head_dim-64 forward. And
    PURE[row] = 1 when the row is plain padding: every key of [lo, hi) live with a bias of exactly 0 (or
    no live key at all), so that hiding the keys outside [lo, hi) is the whole mask and the Gluon forward
    adds no bias there."""
    row = tl.program_id(0)
    mask_row = MASK + (row // HM).to(tl.int64) * stride_mb + (row % HM) * stride_mh
    first = seqlen_k
    last = -1
    n_live = 0
    n_biased = 0  # live keys whose bias is not 0
    for start in range(0, bias_len if WRITE_BIAS else seqlen_k, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        in_seq = cols < seqlen_k
        m = tl.load(mask_row + cols * stride_mn, mask=in_seq, other=0)
        live = _live_keys(m, MASK_IS_BOOL) & in_seq
        first = tl.minimum(first, tl.min(tl.where(live, cols, seqlen_k), 0))
        last = tl.maximum(last, tl.max(tl.where(live, cols, -1), 0))
        if WRITE_BIAS:
            bias = _apply_mask(tl.zeros([CHUNK], dtype=tl.float32), m, MASK_IS_BOOL)
            tl.store(BIAS + row.to(tl.int64) * bias_len + cols, tl.where(in_seq, bias, float("-inf")),
                     mask=cols < bias_len)
            n_live += tl.sum(live.to(tl.int32), 0)
            n_biased += tl.sum((live & (bias != 0.0)).to(tl.int32), 0)
    tl.store(RANGE + row * 2, tl.where(last < 0, 0, first))
    tl.store(RANGE + row * 2 + 1, last + 1)
    if WRITE_BIAS:
        pure = (n_live == 0) | ((n_live == last + 1 - first) & (n_biased == 0))
        tl.store(PURE + row, pure.to(tl.int32))


def mask_key_ranges(mask, mask_strides, seqlen_k, mask_is_bool, launch, bias_len=0):
    """The (rows, 2) int32 output of _mask_key_range_kernel for a query-broadcast mask (one row per
    (batch, head) of the mask, broadcast dims counted once) and its (batch, head) strides in elements;
    with bias_len (>= seqlen_k), also WRITE_BIAS's (rows, bias_len) fp32 bias rows and (rows,) int32 pure
    flags, returned third and fourth."""
    bm, hm = mask.shape[0], mask.shape[1]
    ranges = torch.empty((bm * hm, 2), dtype=torch.int32, device=mask.device)
    bias, pure = ranges, ranges
    if bias_len:
        bias = torch.empty((bm * hm, bias_len), dtype=torch.float32, device=mask.device)
        pure = torch.empty((bm * hm,), dtype=torch.int32, device=mask.device)
    launch(_mask_key_range_kernel)[(bm * hm,)](
        mask, ranges, bias, pure, mask_strides[0], mask_strides[1], mask_strides[3], hm, seqlen_k, bias_len,
        MASK_IS_BOOL=mask_is_bool, CHUNK=KEY_RANGE_CHUNK, WRITE_BIAS=bias_len > 0, num_warps=4,
    )
    strides = (2 * hm if bm > 1 else 0, 2 if hm > 1 else 0)
    return (ranges, strides, bias, pure) if bias_len else (ranges, strides)


@triton.jit
def _narrow_to_live_keys(key_lo, key_hi, lo, hi, BLOCK_N: tl.constexpr):
    """A program's key range [lo, hi) without the key blocks that lie wholly outside its mask row's live
    keys [key_lo, key_hi) (_mask_key_range_kernel). Only whole blocks go: the bounds stay multiples of
    BLOCK_N (or hi stays the sequence end), so the kept blocks keep their place in the pipelined loop, and
    the mask is still applied to each of them (a hole inside the range, the row's edge blocks)."""
    lo = tl.maximum(lo, (key_lo // BLOCK_N) * BLOCK_N)
    hi = tl.minimum(hi, tl.cdiv(key_hi, BLOCK_N) * BLOCK_N)
    return lo, hi


@triton.jit
def _attention_fwd_inner(
    acc,
    l_i,
    m_i,
    q,
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
    # The pipelined loop's mask load is a plain load (Triton pipelines only the loads that feed a dot):
    # issued in its own iteration, its latency stalled every block (sm_90 TTGIR: a synchronous tt.load after
    # the QK^T wait). PREFETCH_MASK loads the next block's mask one iteration ahead instead.
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
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, offs_m, start_n, seqlen_k, bh, dropout_threshold, BLOCK_M, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attention_fwd_blocks(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, seed, stride_kn, stride_vn, stride_mn, offs_m, offs_n,
    offs_d, lo, full_lo, full_hi, hi, seqlen_k, diag, window_left, window_right, qk_scale,
    dropout_threshold, bh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREFETCH_MASK: tl.constexpr = False,
):
    """All key blocks of a query block: [lo, full_lo) and [full_hi, hi) with element masks, the pipelined
    [full_lo, full_hi) without."""
    acc, l_i, m_i = _attention_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, seed, stride_kn, stride_vn, stride_mn, offs_m, offs_n,
        offs_d, lo, full_lo, seqlen_k, diag, window_left, window_right, qk_scale,
        dropout_threshold, bh, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True, HAS_MASK, MASK_IS_BOOL,
        HAS_DROPOUT, HAS_LEFT, HAS_RIGHT, 1,
    )
    acc, l_i, m_i = _attention_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, seed, stride_kn, stride_vn, stride_mn, offs_m, offs_n,
        offs_d, full_lo, full_hi, seqlen_k, diag, window_left, window_right, qk_scale,
        dropout_threshold, bh, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, False, HAS_MASK, MASK_IS_BOOL,
        HAS_DROPOUT, HAS_LEFT, HAS_RIGHT, NUM_STAGES, PREFETCH_MASK,
    )
    return _attention_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, seed, stride_kn, stride_vn, stride_mn, offs_m, offs_n,
        offs_d, full_hi, hi, seqlen_k, diag, window_left, window_right, qk_scale,
        dropout_threshold, bh, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True, HAS_MASK, MASK_IS_BOOL,
        HAS_DROPOUT, HAS_LEFT, HAS_RIGHT, 1,
    )


@triton.jit
def _attention_fwd_kernel(
    Q,
    K,
    V,
    MASK,
    SEED,
    OUT,
    LSE,
    CU_Q,
    CU_K,
    KEY_RANGE,  # tensors; MASK/SEED/CU_*/KEY_RANGE may be dummies (see HAS_*, NARROW_KEYS)
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
    stride_vd,  # v (B, Hkv, Sk, D)
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,  # mask, 0 on broadcast dims
    stride_rb,
    stride_rh,  # KEY_RANGE rows of a batch / head (0 where the mask broadcasts)
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,  # out like q
    stride_lb,
    stride_lh,
    stride_lm,  # logsumexp (B, Hq, Sq) fp32
    H,
    GROUP,
    SEQ_Q,
    SEQ_K,  # heads of q, Hq // Hkv, sequence lengths (dense)
    qk_scale,
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
    NARROW_KEYS: tl.constexpr,  # skip the key blocks outside KEY_RANGE (a query-broadcast mask's live keys)
    PREFETCH_MASK: tl.constexpr,
    BH_ON_X: tl.constexpr,  # (batch, head) pairs on the grid's first axis (bh_grid: more than 65535)
    GROUP_CTAS: tl.constexpr,  # the launch order's groups (_grid_ids, causal_group_ctas)
):
    pid_m, pid_bh = _grid_ids(BH_ON_X, True, GROUP_CTAS)
    # Inductor passes Python floats as fp64: keep the softmax in fp32
    qk_scale = tl.cast(qk_scale, tl.float32)
    dropout_scale = tl.cast(dropout_scale, tl.float32)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
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
    q_ptrs = (
        Q
        + b.to(tl.int64) * stride_qb
        + h * stride_qh
        + (q_start + offs_m[:, None]).to(tl.int64) * stride_qm
        + offs_d[None, :] * stride_qd
    )
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
    row_ok = offs_m[:, None] < seqlen_q
    q = tl.load(q_ptrs, mask=row_ok & (offs_d[None, :] < HEAD_DIM), other=0.0)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)

    # Key blocks: [lo, full_lo) and [full_hi, hi) need element masks; [full_lo, full_hi) do not.
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = tl.maximum(m0 + diag - window_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        full_lo = tl.maximum(m0 + BLOCK_M - 1 + diag - window_left, 0)
        full_lo = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(m0 + BLOCK_M - 1 + diag + window_right + 1, seqlen_k)
        full_hi = tl.minimum(full_hi, ((m0 + diag + window_right + 1) // BLOCK_N) * BLOCK_N)
    if NARROW_KEYS:
        # loaded here, not in the helper: Inductor's mutation analysis takes pointers passed to calls
        # for written ones
        key_range = KEY_RANGE + b * stride_rb + h * stride_rh
        lo, hi = _narrow_to_live_keys(tl.load(key_range), tl.load(key_range + 1), lo, hi, BLOCK_N)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bh = pid_bh
    acc, l_i, m_i = _attention_fwd_blocks(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, seed, stride_kn, stride_vn, stride_mn, offs_m, offs_n,
        offs_d, lo, full_lo, full_hi, hi, seqlen_k, diag, window_left, window_right, qk_scale,
        dropout_threshold, bh, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, MASK_IS_BOOL, HAS_DROPOUT,
        HAS_LEFT, HAS_RIGHT, NUM_STAGES, PREFETCH_MASK,
    )

    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    if HAS_DROPOUT:
        inv_l = inv_l * dropout_scale
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_ptrs = (
        OUT
        + b.to(tl.int64) * stride_ob
        + h * stride_oh
        + (q_start + offs_m[:, None]).to(tl.int64) * stride_om
        + offs_d[None, :] * stride_od
    )
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok & (offs_d[None, :] < HEAD_DIM))
    l_ptrs = LSE + b.to(tl.int64) * stride_lb + h * stride_lh + (q_start + offs_m) * stride_lm
    tl.store(l_ptrs, lse, mask=offs_m < seqlen_q)


# Mask speed switches (module constants, so that bench_attention.py --mask-switches can A/B them in one
# process; H200 GPU time, CUDA graphs timed in interleaved rounds,
# bench/logs/attention_mask_switches_h200.log).
# - NARROW_PADDING_KEYS: the forward and dQ kernels skip the key blocks outside a query-broadcast mask's
#   live keys (one small _mask_key_range_kernel launch per call). Only at head_dim <= 64, with the forward
#   on the 4-warp tile of PADDING_FWD_CONFIGS, where it measured faster: BERT's (32, 12, 512, 64) with a
#   bool padding row (sequences S/2..S long) forward 143.8 -> 122.1 us with dropout 0.1 and 102.6 -> 89.1
#   us without; the grid's (8, 16, 2048, 64) additive row 378 -> 356 us; the dQ kernel 274 -> 255 and
#   1110 -> 1061 us. On the 8-warp 128 x 64 tile (one program per SM) it measured slower (143.8 -> 161.6
#   us), as the session-6 attempt had found without knowing why: no other program hides the wait for the
#   loaded loop bounds.
# - PREFETCH_MASK_TILES / _ROWS: the pipelined key loop loads the next block's (Sq, Sk) mask tile / padding
#   row one iteration ahead (Triton issues these plain loads synchronously, after the QK^T wait). A tile:
#   854 -> 769 us at (8, 16, 2048, 64), so on. A row: slower in 5 of 6 cases (e.g. 122.1 -> 126.5 us), off.
# Both apply only at the head_dims they were measured at (MASK_SWITCH_HEAD_DIMS): at 128 / 256 the 8-warp
# tiles stay (narrowing there is the case that measured slower) and a prefetched tile costs registers
# that no measurement has weighed.
NARROW_PADDING_KEYS = True
PADDING_FWD_CONFIGS = {(64, False): (64, 64, 4, 3), (64, True): (64, 64, 4, 3)}
PREFETCH_MASK_ROWS = False
PREFETCH_MASK_TILES = True
MASK_SWITCH_HEAD_DIMS = (64,)


def mask_speed_flags(attn_mask, head_dim: int) -> tuple[bool, bool]:
    """(narrow to live keys, prefetch the mask) for a launch with this attn_mask (None: neither)."""
    if attn_mask is None or head_dim_bucket(head_dim) not in MASK_SWITCH_HEAD_DIMS:
        return False, False
    if mask_is_query_broadcast(attn_mask):
        return NARROW_PADDING_KEYS, PREFETCH_MASK_ROWS
    return False, PREFETCH_MASK_TILES


def mask_is_query_broadcast(attn_mask) -> bool:
    """A (B, H, 1, Sk)-like mask (padding): the kernels load one row of it per key block, never a tile."""
    return attn_mask is not None and (attn_mask.shape[2] == 1 or attn_mask.stride(2) == 0)


def _mask_args(attn_mask, dummy):
    if attn_mask is None:
        return dummy, (0, 0, 0, 0), False, False
    strides = tuple(0 if attn_mask.shape[d] == 1 else attn_mask.stride(d) for d in range(4))
    return attn_mask, strides, True, attn_mask.dtype == torch.bool


def _launch(
    q,
    k,
    v,
    attn_mask,
    seed,
    dropout_p,
    scale,
    window_left,
    window_right,
    bottom_right,
    out,
    lse,
    q_strides,
    k_strides,
    v_strides,
    o_strides,
    l_strides,
    B,
    H,
    Hkv,
    seq_q,
    seq_k,
    max_seqlen_q,
    cu_q,
    cu_k,
    causal_hint,
    config,
    launch,
):
    D = q.shape[-1]
    dummy = absent_pointer(q, launch)  # stands for absent optional pointers; never read
    mask_t, m_strides, has_mask, mask_is_bool = _mask_args(attn_mask, dummy)
    mask_1d = mask_is_query_broadcast(attn_mask)
    narrow, prefetch = mask_speed_flags(attn_mask, D)
    # a query-broadcast mask is one row load per key block: the no-mask tiles fit in shared memory
    # varlen (cu_q) sizes its key blocks by the longest sequence: the short-keys tile is for dense batches
    short_keys = cu_q is None and short_keys_tile(D, window_right >= 0 or window_left >= 0, has_mask,
                                                  dropout_p > 0.0, seq_k)
    block_m, block_n, num_warps, num_stages = fwd_config(D, causal_hint, has_mask and not mask_1d, config,
                                                         has_dropout=dropout_p > 0.0, narrow=narrow,
                                                         short_keys=short_keys)
    if dropout_p > 0.0 and block_n % DROPOUT_KEY_SPAN:
        raise ValueError(
            f"attention forward: BLOCK_N must be a multiple of {DROPOUT_KEY_SPAN} with dropout (a Philox "
            f"call serves {DROPOUT_KEYS_PER_CALL} keys spread over {DROPOUT_KEY_SPAN}), got {block_n}"
        )
    key_ranges, r_strides = dummy, (0, 0)
    if narrow:
        key_ranges, r_strides = mask_key_ranges(attn_mask, m_strides, seq_k, mask_is_bool, launch)
    grid, bh_on_x = bh_grid(cdiv(max_seqlen_q, block_m), B * H)
    launch(_attention_fwd_kernel)[grid](
        q,
        k,
        v,
        mask_t,
        seed if seed is not None else dummy,
        out,
        lse,
        cu_q if cu_q is not None else dummy,
        cu_k if cu_k is not None else dummy,
        key_ranges,
        *q_strides,
        *k_strides,
        *v_strides,
        *m_strides,
        *r_strides,
        *o_strides,
        *l_strides,
        H,
        H // Hkv,
        seq_q,
        seq_k,
        scale * LOG2E,
        dropout_threshold(dropout_p),
        dropout_scale(dropout_p),
        window_left,
        window_right,
        HEAD_DIM=D,
        BLOCK_D=max(next_power_of_2(D), 16),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_MASK=has_mask,
        MASK_1D=mask_1d,
        MASK_IS_BOOL=mask_is_bool,
        HAS_DROPOUT=dropout_p > 0.0,
        IS_VARLEN=cu_q is not None,
        BOTTOM_RIGHT=bottom_right,
        HAS_LEFT=window_left >= 0,
        HAS_RIGHT=window_right >= 0,
        NUM_STAGES=num_stages,
        NARROW_KEYS=narrow,
        PREFETCH_MASK=prefetch,
        BH_ON_X=bh_on_x,
        GROUP_CTAS=causal_group_ctas(q.device, causal_hint, bh_on_x),
        num_warps=num_warps,
        num_stages=num_stages,
    )


def attention_forward_launch(
    q,
    k,
    v,
    attn_mask,
    seed,
    dropout_p,
    scale,
    window_left,
    window_right,
    bottom_right,
    out,
    lse,
    *,
    config=None,
    launch=traced_launch,
):
    """Fill out (B, Hq, Sq, D) and lse (B, Hq, Sq) for (B, H, S, D) inputs of any strides."""
    B, H, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    _launch(
        q,
        k,
        v,
        attn_mask,
        seed,
        dropout_p,
        scale,
        window_left,
        window_right,
        bottom_right,
        out,
        lse,
        q.stride(),
        k.stride(),
        v.stride(),
        out.stride(),
        lse.stride(),
        B,
        H,
        Hkv,
        Sq,
        Sk,
        Sq,
        None,
        None,
        window_right == 0,
        config,
        launch,
    )


def attention_varlen_forward_launch(
    q,
    k,
    v,
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
    out,
    lse,
    *,
    config=None,
    launch=traced_launch,
):
    """Packed (T, H, D) sequences: batch b is rows cu[b]:cu[b+1]; lse is (H, Tq)."""
    _, H, _ = q.shape
    Hkv = k.shape[1]
    B = cu_q.shape[0] - 1

    def bhsd(t):  # (T, H, D) strides seen as (B, H, S, D) with no batch stride
        return (0, t.stride(1), t.stride(0), t.stride(2))

    _launch(
        q,
        k,
        v,
        None,
        seed,
        dropout_p,
        scale,
        window_left,
        window_right,
        bottom_right,
        out,
        lse,
        bhsd(q),
        bhsd(k),
        bhsd(v),
        bhsd(out),
        (0, lse.stride(0), lse.stride(1)),
        B,
        H,
        Hkv,
        0,
        0,
        max_seqlen_q,
        cu_q,
        cu_k,
        window_right == 0,
        config,
        launch,
    )
