"""Attention backward for Hopper (sm_90) in Gluon at head_dim 256.

Why a kernel of its own: the head_dim 64 / 128 Gluon backward (kernels/attention_bwd_hopper.py) gives each
consumer warpgroup 64 keys and keeps that warpgroup's dK and dV, [64, head_dim] each, in fp32 registers.
At head_dim 256 that is 256 registers a thread for the accumulators alone, so head_dim 256 ran the Triton
backward, at ~0.75x cuDNN's backward (bench/results/attention.json at 8d4f31b: fwd+bwd 0.78x / 0.80x with
the forward at 1.00x / 1.05x). Here the two consumer warpgroups share one block of 64 keys and split the
work the other way round (FlashAttention-3's layout for this head_dim):

- dK and dV: warpgroup w keeps columns [128 w, 128 w + 128) of head_dim for all 64 keys (64 + 64 fp32
  registers a thread);
- S^T = K Q^T and dP^T = V dO^T: warpgroup w computes the 32 query columns [32 w, 32 w + 32) of the query
  block (64 keys are wgmma's M; the contraction runs over all of head_dim), then P^T and dS^T for them;
- both warpgroups' P^T and dS^T columns meet in shared memory (one [64 keys, 64 queries] tile each), and
  each warpgroup then computes, for its head_dim columns,
      dV[:, cols] += P^T dO[:, cols],  dK[:, cols] += dS^T Q[:, cols],  dQ[:, cols] = dS K[:, cols]
  dQ in two 64-column products, each added into the fp32 (B * H, Sq, head_dim) buffer by TMA's reduce-add
  as the other kernel does.

Shared memory (bf16 / fp16): K and V 32 KB each, two stages of Q (64 KB), one of dO (32 KB), the P^T and
dS^T tiles (8 KB each) and one 16 KB fp32 dQ tile a warpgroup: 208 KB of the 227 KB a CTA may have (a
second P^T / dS^T buffer fits, and measured within 1 %). The P^T / dS^T tiles use a 64-byte swizzle, so that
each warpgroup's 32 columns are whole swizzle blocks.

On the H200 (bench/logs/attention_gluon_bwd256_probe_s26_h200.log, backward alone): 0.88-0.97x cuDNN's
backward and 1.21-1.36x the Triton backward at 2,16,4096 and 1,16,16384, causal or not; GQA 4:1 0.81-0.84x
cuDNN's (which ran on expanded K / V there).

Scope and determinism as the other Gluon backward (kernels/attention_bwd_hopper.py decides the routing).
"""

from __future__ import annotations

import functools

from flash_backend.kernels.attention_bwd_hopper import GLUON_AVAILABLE

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from flash_backend.kernels.attention_bwd_hopper import (
        STAT_LAYOUT,
        _first_block,
        _key_block,
        _query_stats,
        _tma_add_shared_to_global,
    )

# The kernel reads these from its descriptors' and buffers' shapes; the host builds those from them.
KEYS = 64  # keys a CTA (wgmma's M), shared by both consumer warpgroups
BLOCK_M = 64  # query rows an iteration; each warpgroup computes S^T / dP^T for half of them
HALF_DIM = 128  # head_dim columns of dK / dV / dQ one warpgroup owns
DQ_CHUNK = 64  # dQ columns a product (and a reduce-add) covers
# (Q ring depth, dO ring depth): (2, 1) measured 1.04-1.13x (1, 2) and (1, 1) on the H200
# (bench/logs/attention_gluon_bwd256_probe_s26_h200.log); two stages of both would not fit
CONFIG = (2, 1)


if GLUON_AVAILABLE:

    @gluon.jit
    def _producer_256(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_tile, v_tile, q_ready, q_empty,
                      do_ready, do_empty, kv_bar, batch, kv_head, group, n0, q_block_start, n_q_blocks,
                      first_block):
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        Q_ST: gl.constexpr = q_bufs.type.shape[0]
        DO_ST: gl.constexpr = do_bufs.type.shape[0]
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [batch, kv_head, n0, 0], kv_bar, k_tile.index(0))
        tma.async_copy_global_to_shared(v_desc, [batch, kv_head, n0, 0], kv_bar, v_tile.index(0))
        g = 0  # the consumers' order, counted (_consumer_256 says why)
        j = 0
        block = first_block
        for it in range(group * n_q_blocks):
            head = kv_head * group + g
            m0 = (q_block_start + block) * BLOCK_M
            head_ends = j + 1 == n_q_blocks
            g = g + head_ends.to(gl.int32)
            j = gl.where(head_ends, 0, j + 1)
            block = gl.where(block + 1 == n_q_blocks, 0, block + 1)
            # a buffer's first use waits on parity 1, which a fresh mbarrier counts as complete
            q_stage = it % Q_ST
            mbarrier.wait(q_empty.index(q_stage), ((it // Q_ST) & 1) ^ 1)
            mbarrier.expect(q_ready.index(q_stage), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [batch, head, m0, 0], q_ready.index(q_stage),
                                            q_bufs.index(q_stage))
            do_stage = it % DO_ST
            mbarrier.wait(do_empty.index(do_stage), ((it // DO_ST) & 1) ^ 1)
            mbarrier.expect(do_ready.index(do_stage), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [batch, head, m0, 0], do_ready.index(do_stage),
                                            do_bufs.index(do_stage))

    @gluon.jit
    def _consumer_256(WG: gl.constexpr, dk_desc, dv_desc, dq_desc, q_bufs, do_bufs, k_tile, v_tile, pt_tile,
                      dst_tile, dq_tiles, q_ready, q_empty, do_ready, do_empty, kv_bar, pds_ready, pds_empty,
                      LSE, DELTA, batch, kv_head, group, num_heads, n0, q_block_start, n_q_blocks,
                      first_block, seq_q, qk_scale, scale, CAUSAL: gl.constexpr):
        """Consumer warpgroup WG: query columns [32 WG, 32 WG + 32) of S^T, head_dim columns
        [128 WG, 128 WG + 128) of dK, dV and dQ."""
        dtype: gl.constexpr = q_bufs.dtype
        HEAD_DIM: gl.constexpr = q_bufs.type.shape[4]  # q_bufs: [Q_STAGES, 1, 1, BLOCK_M, HEAD_DIM]
        BLOCK_M: gl.constexpr = q_bufs.type.shape[3]
        KEYS: gl.constexpr = k_tile.type.shape[3]  # k_tile: [1, 1, 1, KEYS, HEAD_DIM]
        HALF_DIM: gl.constexpr = HEAD_DIM // 2
        DQ_CHUNK: gl.constexpr = dq_tiles.type.shape[3]  # dq_tiles: [2, 1, BLOCK_M, DQ_CHUNK]
        Q_ST: gl.constexpr = q_bufs.type.shape[0]
        DO_ST: gl.constexpr = do_bufs.type.shape[0]
        COLS: gl.constexpr = BLOCK_M // 2  # query columns of S^T this warpgroup computes
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, COLS, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HALF_DIM, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_CHUNK, 16])
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # one value per query (S^T's columns)

        k_smem = k_tile.index(0).reshape([KEYS, HEAD_DIM])
        v_smem = v_tile.index(0).reshape([KEYS, HEAD_DIM])
        d0: gl.constexpr = WG * HALF_DIM  # this warpgroup's first head_dim column
        c0: gl.constexpr = WG * COLS  # and its first query column of S^T
        k_dq0 = k_smem.slice(d0, DQ_CHUNK, dim=1)  # dQ's B operands
        k_dq1 = k_smem.slice(d0 + DQ_CHUNK, DQ_CHUNK, dim=1)
        pt_mine = pt_tile.slice(c0, COLS, dim=1)  # [KEYS, COLS]: this warpgroup's query columns
        dst_mine = dst_tile.slice(c0, COLS, dim=1)
        ds_t = dst_tile.permute((1, 0))  # dS, (BLOCK_M, KEYS): dQ's A operand
        dq_smem = dq_tiles.index(WG).reshape([BLOCK_M, DQ_CHUNK])
        keys = n0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
        zero_s = gl.full([KEYS, COLS], 0.0, gl.float32, s_layout)
        zero_dq = gl.full([BLOCK_M, DQ_CHUNK], 0.0, gl.float32, dq_layout)
        dk = gl.full([KEYS, HALF_DIM], 0.0, gl.float32, kv_layout)
        dv = gl.full([KEYS, HALF_DIM], 0.0, gl.float32, kv_layout)
        mbarrier.wait(kv_bar, 0)

        n_iter = group * n_q_blocks
        # each block's logsumexp and delta loaded a block ahead, as attention_bwd_hopper._consumer does
        # (1.00-1.06x loaded in the iteration; starting the products from them as that kernel does measured
        # 0.90-0.97x here: bench/logs/attention_gluon_bwd256_stats_ahead_s30_h200.log,
        # attention_gluon_bwd_acc_init_ab_s30_h200.log)
        first_row = batch * num_heads + kv_head * group
        stat_cols = c0 + gl.arange(0, COLS, layout=STAT_LAYOUT)
        lse_ahead, delta_ahead = _query_stats(LSE, DELTA, first_row, seq_q,
                                              (q_block_start + first_block) * BLOCK_M + stat_cols, n_iter > 0)
        # The head g of the GQA group, the count j of its query blocks and the block itself (from
        # first_block round to the one before it: _first_block) are counted, not derived from `it` (a 32-bit
        # division and remainder an iteration; nested loops over g and j, as the head_dim 64 / 128 kernel
        # runs, spilled 500+ more bytes here)
        g = 0
        j = 0
        block = first_block
        for it in range(n_iter):
            head = kv_head * group + g
            m0 = (q_block_start + block) * BLOCK_M
            head_ends = j + 1 == n_q_blocks
            g = g + head_ends.to(gl.int32)
            j = gl.where(head_ends, 0, j + 1)
            block = gl.where(block + 1 == n_q_blocks, 0, block + 1)
            q_stage = it % Q_ST
            do_stage = it % DO_ST
            q_smem = q_bufs.index(q_stage).reshape([BLOCK_M, HEAD_DIM])
            do_smem = do_bufs.index(do_stage).reshape([BLOCK_M, HEAD_DIM])
            q_cols = q_smem.slice(c0, COLS, dim=0).permute((1, 0))  # (HEAD_DIM, COLS)
            do_cols = do_smem.slice(c0, COLS, dim=0).permute((1, 0))
            mbarrier.wait(q_ready.index(q_stage), (it // Q_ST) & 1)
            s_tok = warpgroup_mma(k_smem, q_cols, zero_s, use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(do_stage), (it // DO_ST) & 1)
            dp_tok = warpgroup_mma(v_smem, do_cols, zero_s, use_acc=False, is_async=True)
            queries = m0 + c0 + gl.arange(0, COLS, layout=col_layout)
            lse = gl.convert_layout(lse_ahead, col_layout)
            delta = gl.convert_layout(delta_ahead, col_layout)
            lse_ahead, delta_ahead = _query_stats(LSE, DELTA, first_row + g, seq_q,
                                                  (q_block_start + block) * BLOCK_M + stat_cols,
                                                  it + 1 < n_iter)

            s, _, _ = warpgroup_mma_wait(1, deps=(s_tok, k_smem, q_cols))
            p = gl.exp2(s * qk_scale - gl.expand_dims(lse, 0))
            if CAUSAL:
                if m0 < n0 + KEYS:  # the block has queries before some of these keys
                    p = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(queries, 0), p, 0.0)
            dp, _, _ = warpgroup_mma_wait(0, deps=(dp_tok, v_smem, do_cols))
            ds = p * (dp - gl.expand_dims(delta, 0))

            # P^T and dS^T: both warpgroups' columns, one buffer (both read the previous block's first; two
            # buffers measured within 1 %, bench/logs/attention_gluon_bwd256_variants_s26_h200.log)
            mbarrier.wait(pds_empty, (it & 1) ^ 1)
            pt_mine.store(p.to(dtype))
            dst_mine.store(ds.to(dtype))
            fence_async_shared()
            gl.thread_barrier()  # every thread's part is stored before the arrive (thread 0's) says so
            mbarrier.arrive(pds_ready, count=1)
            mbarrier.wait(pds_ready, it & 1)

            # dQ's first half goes out first: its reduce-add then overlaps dV's and dK's products (issuing
            # both halves first, to store the second during them too, measured 0.73-0.83x: more spills)
            dq_row = batch * num_heads + head
            dq_tok = warpgroup_mma(ds_t, k_dq0, zero_dq, use_acc=False, is_async=True)
            dv_tok = warpgroup_mma(pt_tile, do_smem.slice(d0, HALF_DIM, dim=1), dv, is_async=True)
            dk_tok = warpgroup_mma(dst_tile, q_smem.slice(d0, HALF_DIM, dim=1), dk, is_async=True)
            dq, _, _ = warpgroup_mma_wait(2, deps=(dq_tok, ds_t, k_dq0))
            tma.store_wait(0)  # the previous reduce-add has read the tile
            dq_smem.store(dq * scale)
            fence_async_shared()
            gl.thread_barrier()
            _tma_add_shared_to_global(dq_desc, [dq_row, m0, d0], dq_tiles.index(WG))
            # (waiting for dV's product alone first, to free the single dO buffer for the next block's load
            # sooner, measured the same to 0.1 %: bench/logs/attention_gluon_bwd256_early_do_s26_h200.log)
            dq_tok = warpgroup_mma(ds_t, k_dq1, zero_dq, use_acc=False, is_async=True)
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
            mbarrier.arrive(q_empty.index(q_stage), count=1)
            mbarrier.arrive(do_empty.index(do_stage), count=1)
            mbarrier.arrive(pds_empty, count=1)
            tma.store_wait(0)
            dq_smem.store(dq * scale)
            fence_async_shared()
            gl.thread_barrier()
            _tma_add_shared_to_global(dq_desc, [dq_row, m0, d0 + DQ_CHUNK], dq_tiles.index(WG))

        # dV and dK leave through this warpgroup's columns of the V and K tiles: after the last P / dS
        # barrier only this warpgroup reads them (S^T and dP^T, which read every column, are done)
        v_smem.slice(d0, HALF_DIM, dim=1).store(dv.to(dtype))
        k_smem.slice(d0, HALF_DIM, dim=1).store((dk * scale).to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(dv_desc, [batch, kv_head, n0, d0], v_tile.index(0).slice(d0, HALF_DIM,
                                                                                                 dim=3))
        tma.async_copy_shared_to_global(dk_desc, [batch, kv_head, n0, d0], k_tile.index(0).slice(d0, HALF_DIM,
                                                                                                 dim=3))
        tma.store_wait(0)

    # rows_per_group not specialised: see attention_fwd_hopper's kernel
    @gluon.jit(do_not_specialize=["rows_per_group"])
    def _attention_bwd_hopper_256_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE,
                                         DELTA, seq_q, num_heads, group, qk_scale, scale, rows_per_group,
                                         Q_STAGES: gl.constexpr, DO_STAGES: gl.constexpr,
                                         CAUSAL: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                         CONSUMER_REGS: gl.constexpr):
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        KEYS: gl.constexpr = k_desc.block_type.shape[2]
        n0, batch, kv_head, q_block_start, n_q_blocks = _key_block(KEYS, num_heads, group, seq_q, BLOCK_M,
                                                                   CAUSAL, rows_per_group)
        first_block = _first_block(n0 // KEYS, n_q_blocks, not CAUSAL)  # (kernels/attention_bwd_hopper.py)

        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [Q_STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(do_desc.dtype, [DO_STAGES] + do_desc.block_type.shape,
                                            do_desc.layout)
        k_tile = gl.allocate_shared_memory(k_desc.dtype, [1] + k_desc.block_type.shape, k_desc.layout)
        v_tile = gl.allocate_shared_memory(v_desc.dtype, [1] + v_desc.block_type.shape, v_desc.layout)
        # a 64-byte swizzle: a warpgroup's 32 query columns (64 bytes) are whole swizzle blocks of their own
        pds: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
        pt_tile = gl.allocate_shared_memory(q_desc.dtype, [KEYS, BLOCK_M], pds)
        dst_tile = gl.allocate_shared_memory(q_desc.dtype, [KEYS, BLOCK_M], pds)
        dq_tiles = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
        do_empty = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
        pds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        pds_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(Q_STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # both consumers read every query block
        for i in gl.static_range(DO_STAGES):
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(do_empty.index(i), count=2)
        mbarrier.init(pds_ready, count=2)
        mbarrier.init(pds_empty, count=2)
        mbarrier.init(kv_bar, count=1)

        # argument tuples written in the call (a tuple in a variable turns its constexprs into tensors)
        gl.warp_specialize([
            (_consumer_256, (0, dk_desc, dv_desc, dq_desc, q_bufs, do_bufs, k_tile, v_tile, pt_tile,
                             dst_tile, dq_tiles, q_ready, q_empty, do_ready, do_empty, kv_bar, pds_ready,
                             pds_empty, LSE, DELTA, batch, kv_head, group, num_heads, n0, q_block_start,
                             n_q_blocks, first_block, seq_q, qk_scale, scale, CAUSAL)),
            (_consumer_256, (1, dk_desc, dv_desc, dq_desc, q_bufs, do_bufs, k_tile, v_tile, pt_tile,
                             dst_tile, dq_tiles, q_ready, q_empty, do_ready, do_empty, kv_bar, pds_ready,
                             pds_empty, LSE, DELTA, batch, kv_head, group, num_heads, n0, q_block_start,
                             n_q_blocks, first_block, seq_q, qk_scale, scale, CAUSAL)),
            (_producer_256, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_tile, v_tile, q_ready,
                             q_empty, do_ready, do_empty, kv_bar, batch, kv_head, group, n0, q_block_start,
                             n_q_blocks, first_block)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------------------------------------------- host


def _descriptors(q, k, v, dout, dk, dv, dq_acc):
    """The kernel's seven TMA descriptors: Q / dO / K / V by [1, 1, 64, 256] tiles, dK / dV stored by each
    warpgroup's [1, 1, 64, 128] half, dQ added by [1, 64, 64] fp32 chunks."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flash_backend.kernels.attention_fwd_hopper import _descriptor, _tile

    def halves(t):
        block, layout = _tile(KEYS, HALF_DIM, t.dtype)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    dq_block, dq_layout = dq_tile()
    return (_descriptor(q, BLOCK_M), _descriptor(k, KEYS), _descriptor(v, KEYS), _descriptor(dout, BLOCK_M),
            halves(dk), halves(dv),
            TensorDescriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), dq_block, dq_layout))


@functools.cache
def dq_tile():
    """The fp32 dQ chunk a reduce-add covers and its shared layout."""
    block = [1, BLOCK_M, DQ_CHUNK]
    return block, gl.NVMMASharedLayout.get_default_for(block, gl.float32)


def launch(q, k, v, dout, dk, dv, dq_acc, lse, delta, scale, causal, config=CONFIG, rows_per_group=None):
    """Fill dk, dv and add dQ (times the softmax scale) into dq_acc, (B * H, Sq, 256) fp32 and zeroed by
    the caller; lse and delta are (B * H, Sq) fp32; rows_per_group as attention_bwd_hopper's launcher
    takes it. The caller (kernels/attention_bwd_hopper.py) checked the call and the strides."""
    from flash_backend._fast_launch import fast_kernel
    from flash_backend._host_math import cdiv
    from flash_backend.kernels.attention_bwd_hopper import (
        _CONSUMER_REGS,
        _MAXNREG,
        _PRODUCER_REGS,
        HEAVIEST_FIRST_WAVES,
    )
    from flash_backend.kernels.attention_fwd_hopper import LOG2E, heaviest_first_rows

    B, H, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    grid = (cdiv(Sk, KEYS), B * Hkv)
    if rows_per_group is None:
        rows_per_group = heaviest_first_rows(*grid, causal, q.device, HEAVIEST_FIRST_WAVES)
    fast_kernel(_attention_bwd_hopper_256_kernel)[grid](
        *_descriptors(q, k, v, dout, dk, dv, dq_acc), lse, delta, Sq, H, H // Hkv, scale * LOG2E, scale,
        rows_per_group,
        Q_STAGES=config[0], DO_STAGES=config[1], CAUSAL=causal,
        PRODUCER_REGS=_PRODUCER_REGS, CONSUMER_REGS=_CONSUMER_REGS, num_warps=4, maxnreg=_MAXNREG,
    )


def compile_sm90(dtype: str, causal: bool, config=CONFIG):
    """The kernel compiled ahead of time for sm_90, no GPU needed (the CPU tests' check of it)."""
    from flash_backend.kernels.attention_bwd_hopper import compile_gluon_bwd_sm90

    tiles = [("q_desc", BLOCK_M, 256), ("k_desc", KEYS, 256), ("v_desc", KEYS, 256),
             ("do_desc", BLOCK_M, 256), ("dk_desc", KEYS, HALF_DIM), ("dv_desc", KEYS, HALF_DIM)]
    return compile_gluon_bwd_sm90(_attention_bwd_hopper_256_kernel, dtype, tiles, dq_tile(),
                                  dict(Q_STAGES=config[0], DO_STAGES=config[1], CAUSAL=causal))
