"""Attention backward for Hopper (sm_90) in Gluon: FlashAttention-3's structure, for the plain cases.

Why a second backward: the Triton backward (kernels/attention_bwd.py) runs at ~0.7x cuDNN's backward on
the H200 (bench/results/attention.json, session 22), and like the forward (kernels/attention_fwd_hopper.py)
what it lacks is warp specialisation and asynchronous wgmma, which Gluon exposes. The work of one CTA:

- a key block of BLOCK_N = 128 keys of one (batch, kv head), split between two consumer warpgroups of 64
  keys each (wgmma's M per warpgroup); each keeps its K and V rows in shared memory and its dK and dV in
  fp32 registers for the whole kernel;
- a producer warp streams the query blocks (BLOCK_M rows of Q and dO, TMA) through a STAGES-deep ring,
  for every query head of the kv head's GQA group in turn (dK / dV of a group sum in registers, no atomics);
- per query block each consumer computes, transposed so that its key rows are wgmma's M:
      S^T = K Q^T - lse / scale,  dP^T = V dO^T - delta
                                              (asynchronous, issued together, each accumulator starting
                                               from the query statistics: lse in base 2, loaded a block ahead)
      P^T = exp2(S^T * scale * log2 e),  dS^T = P^T dP^T
      dV += P^T dO,  dK += dS^T Q             (P^T and dS^T straight from registers, as wgmma's A)
  and dS^T goes to shared memory, where both warpgroups' halves form dS for the 128 keys:
      dQ[:, half] = dS K[:, half]             (each warpgroup one half of head_dim, or, at head_dim 64,
                                               the warpgroups take turns over the query blocks)
  which, scaled by the softmax scale, goes to shared memory and from there is added into an fp32
  (B * H, Sq, head_dim) buffer by TMA's reduce-add: one asynchronous bulk operation a warpgroup, where
  per-element atomics from registers measured 0.67-0.84x cuDNN's backward against 0.86-1.06x this way
  (bench/logs/attention_gluon_bwd_probe_h200.log and session 23's notes).

It is not deterministic (the order of dQ's reduce-adds): with `torch.use_deterministic_algorithms(True)` the
Triton backward runs. Scope (`hopper_backward_supported`): what the Hopper forward takes (no mask but a
non-causal padding mask, no dropout or window, causal top-left, 2**28 scores or more, TMA-compatible
strides), head_dim 64 or 128 (causal 64 from 2048 query rows), and head_dim 256 by kernels/
attention_bwd_hopper_256.py (the warpgroups split head_dim instead of the keys; no mask), which this
module's launcher runs. A padding mask (prepared as the forward takes it, attention_fwd_hopper.
padding_mask_args) adds its bias to S^T's key rows, and a CTA whose keys are dead for every head of its
GQA group visits no query block; its gradient is not computed here (a mask that requires grad keeps the
Triton backward).
"""

from __future__ import annotations

import functools

import torch
import triton

from flash_backend._fast_launch import fast_kernel
from flash_backend._host_math import cdiv, next_power_of_2
from flash_backend.kernels.attention_fwd_hopper import (
    GLUON_AVAILABLE,
    LOG2E,
    _descriptor,
    _tile,
    _tma_ok,
    heaviest_first_rows,
    padding_mask_args,
    plain_attention_case,
    sm90_tma_inputs,
)

if GLUON_AVAILABLE:
    from triton._C.libtriton import gluon_ir as _gluon_ir
    from triton._C.libtriton import ir as _ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin as _builtin
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flash_backend.kernels.attention_fwd_hopper import _heaviest_first

    # the layout the consumers load the query statistics in, a block ahead: one value a thread
    STAT_LAYOUT = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))

    # TMA's reduce-add (cp.reduce.async.bulk.tensor): Gluon 3.6's builder has the op but the language no
    # function for it. Without it (another Triton), every call takes the Triton backward.
    GLUON_AVAILABLE = hasattr(_gluon_ir.GluonOpBuilder, "create_async_tma_reduce") and hasattr(
        _ir, "DESCRIPTOR_REDUCE_KIND")

    @_builtin
    def _tma_add_shared_to_global(tensor_desc, coord, src, _semantic=None):
        """Add the shared-memory tile src into global memory at coord, asynchronously (a bulk group:
        tma.store_wait covers it), as tma.async_copy_shared_to_global stores it."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

KEYS_PER_CONSUMER = 64  # wgmma's M for one warpgroup
BLOCK_N = 2 * KEYS_PER_CONSUMER  # keys a CTA: two consumer warpgroups
# head_dim -> (BLOCK_M, STAGES): query rows an iteration and the depth of the Q / dO ring, the faster of
# bench/attention_gluon_bwd_probe.py's on the H200 (3 stages 1.00-1.07x 2 at head_dim 128 except GQA, 0.99x;
# a tie at 64). BLOCK_M 128 at head_dim 64 spilled 500-600 bytes while the query statistics were live through
# the softmax; since the products start from them (_consumer) it spills 180 and measured 1.02-1.07x BLOCK_M
# 64 from 1024 query rows, 0.95-0.99x below (bench/logs/attention_gluon_bwd_acc_init_ab_s30_h200.log).
# Head_dim 128 at BLOCK_M 128 does not fit shared memory.
CONFIGS = {64: (128, 2), 128: (64, 3)}
SHORT_SEQ_Q_CONFIG_64 = (64, 2)  # head_dim 64 below SHORT_SEQ_Q query rows: fewer blocks to fill the ring
SHORT_SEQ_Q = 1024
# head_dim 256 has a kernel of its own (kernels/attention_bwd_hopper_256.py: the warpgroups split head_dim,
# not the keys); its config is the depth of its Q and dO rings
HEAD_DIMS = (*CONFIGS, 256)
# Without causal masking, from this many keys each CTA starts at a query block of its own (_first_block's
# STAGGER; the head_dim 256 kernel always does): 4,32/8,4096,128 1.08-1.09x, 4,16,4096,128 1.01-1.02x,
# 2,16,8192 at 64 and 128 0.99-1.00x, head_dim 256 1.04x at 4096 keys, 1.03-1.06x at 16384; below it
# 0.98-0.99x at 16,16,1024,64 and 8,16,2048,64 (bench/logs/attention_bwd_stagger_always_s34_h200.log,
# attention_bwd_stagger_s34_h200.log). Without STAGGER the kernel is the one before (the same PTX).
STAGGER_MIN_SEQ_K = 4096
# Causal head_dim 64 below 2048 query rows: the Triton backward's GPU time was shorter (16,16,1024: the Gluon
# one 0.97x its speed, bench/logs/attention_gluon_bwd_probe_h200.log), and the Gluon launch costs more host
# time (seven TMA descriptors): that row's eager fwd+bwd fell from 0.46x to 0.37x cuDNN (attention.json at
# ec3acd5 against efcbc32). From 2048 rows it gains: 1.01-1.02x at 8,16,2048, and 2,16,8192's fwd+bwd went
# from 0.81x to 0.90x cuDNN.
MIN_SEQ_Q_CAUSAL_64 = 2048
# The causal backward's groups of rows (attention_fwd_hopper._heaviest_first): about one wave of CTAs. Each
# row of a group streams its Q, dO and fp32 dQ through L2, and larger groups lost
# (bench/logs/attention_causal_order_probe_s28_h200.log, the kernel alone against the plain order): at
# 8,16,2048,128 groups of 8 rows (128 CTAs) 1.06x, 32 rows 1.02x, 128 rows 0.78x; GQA 4,32/8,4096,128 4 rows
# 1.13x; head_dim 256 (256 CTAs a row) the plain order.
HEAVIEST_FIRST_WAVES = 1
_PRODUCER_REGS = 24
_MAXNREG, _CONSUMER_REGS = 168, 240  # two consumer warpgroups and a producer warp (the forward's budget)


if GLUON_AVAILABLE:

    @gluon.jit
    def _key_block(KEYS_A_CTA: gl.constexpr, num_heads, group, seq_q, BLOCK_M: gl.constexpr,
                   CAUSAL: gl.constexpr, rows_per_group):
        """This CTA's work, from the grid (key blocks, B * Hkv) in the launch order of rows_per_group: its
        first key n0, its (batch, kv head), and the query blocks it visits (q_block_start onwards, n_q_blocks
        of them, per head of the GQA group). Shared by both Gluon backwards (the head_dim 256 one in
        kernels/attention_bwd_hopper_256.py)."""
        if CAUSAL:  # the first key blocks see the most queries
            key_block, bkv = _heaviest_first(rows_per_group)
        else:
            key_block = gl.program_id(0)
            bkv = gl.program_id(1)
        n0 = key_block * KEYS_A_CTA
        num_kv_heads = num_heads // group
        batch = bkv // num_kv_heads
        kv_head = bkv % num_kv_heads
        q_block_start = 0
        if CAUSAL:
            q_block_start = n0 // BLOCK_M  # top-left: queries before n0 see none of these keys
        n_q_blocks = gl.maximum((seq_q + BLOCK_M - 1) // BLOCK_M - q_block_start, 0)
        return n0, batch, kv_head, q_block_start, n_q_blocks

    @gluon.jit
    def _query_stats(LSE, DELTA, row, seq_q, queries, valid):
        """The logsumexp (in base 2, as the kernels work; +inf past seq_q, so that P is 0 there) and delta =
        rowsum(dO * O) of these queries of (batch * heads) row `row`; those of no query where `valid` is
        false (a load ahead past the last block). Shared by both Gluon backwards."""
        row_base = row.to(gl.int64) * seq_q
        in_q = (queries < seq_q) & valid
        lse = gl.load(LSE + row_base + queries, mask=in_q, other=float("inf"))
        lse = lse * 1.4426950408889634  # log2(e)
        delta = gl.load(DELTA + row_base + queries, mask=in_q, other=0.0)
        return lse, delta

    @gluon.jit
    def _block_stats(LSE, DELTA, it, n_iter, first_row, q_block_start, n_q_blocks, seq_q,
                     BLOCK_M: gl.constexpr, cols):
        """_query_stats of iteration it's query block (the group's heads in turn from first_row, each over
        n_q_blocks blocks from q_block_start, in order) at these columns of it, in a compact layout (one
        value a thread: the consumers load each block's an iteration ahead, then convert them to wgmma's
        layout); none past the last iteration (n_q_blocks may be 0 only where n_iter is: it = 0, a quotient
        of 0, nothing loaded)."""
        return _query_stats(LSE, DELTA, first_row + it // n_q_blocks, seq_q,
                            (q_block_start + it % n_q_blocks) * BLOCK_M + cols, it < n_iter)

    @gluon.jit
    def _first_block(key_block, n_q_blocks, STAGGER: gl.constexpr):
        """The query block (counted from _key_block's q_block_start) at which a CTA starts each head of its
        GQA group, going round to the block before it: with STAGGER key block i starts at block i mod
        n_q_blocks, so that the CTAs of one head running at once add their dQ tiles into different rows
        instead of all into the same rows in step; else at block 0 (causal CTAs start at their diagonal,
        already apart). Shared by both Gluon backwards."""
        if STAGGER:
            return key_block % gl.maximum(n_q_blocks, 1)
        else:
            return 0

    @gluon.jit
    def _producer(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_tiles, v_tiles, q_ready, q_empty,
                  do_ready, do_empty, kv_bar, batch, kv_head, group, n0, q_block_start, n_q_blocks,
                  first_block, STAGGER: gl.constexpr):
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        KEYS: gl.constexpr = k_desc.block_type.shape[2]
        STAGES: gl.constexpr = q_bufs.type.shape[0]
        # the key block's K and V, both warpgroups' rows, behind one barrier
        mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for w in gl.static_range(2):
            coord = [batch, kv_head, n0 + w * KEYS, 0]
            tma.async_copy_global_to_shared(k_desc, coord, kv_bar, k_tiles.index(w))
            tma.async_copy_global_to_shared(v_desc, coord, kv_bar, v_tiles.index(w))
        if STAGGER:  # the consumers' order (_consumer): head g of the group, blocks from first_block round
            g = 0
            j = 0
            block = first_block
        for it in range(group * n_q_blocks):
            if STAGGER:
                head = kv_head * group + g
                m0 = (q_block_start + block) * BLOCK_M
                head_ends = j + 1 == n_q_blocks
                g = g + head_ends.to(gl.int32)
                j = gl.where(head_ends, 0, j + 1)
                block = gl.where(block + 1 == n_q_blocks, 0, block + 1)
            else:
                head = kv_head * group + it // n_q_blocks
                m0 = (q_block_start + it % n_q_blocks) * BLOCK_M
            stage = it % STAGES
            # a buffer's first use waits on parity 1, which a fresh mbarrier counts as complete
            empty_phase = ((it // STAGES) & 1) ^ 1
            mbarrier.wait(q_empty.index(stage), empty_phase)
            mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [batch, head, m0, 0], q_ready.index(stage),
                                            q_bufs.index(stage))
            mbarrier.wait(do_empty.index(stage), empty_phase)
            mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [batch, head, m0, 0], do_ready.index(stage),
                                            do_bufs.index(stage))

    @gluon.jit
    def _query_block(WG: gl.constexpr, it, g, j, block, next_block, CAUSAL: gl.constexpr, dk, dv,
                     lse_ahead, delta_ahead, dq_desc, q_bufs, do_bufs, k_smem, v_smem, k0_cols, k1_cols,
                     ds_bufs, dq_smem, dq_tiles, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty,
                     LSE, DELTA, BIAS, keys, first_key, stat_cols, first_row, batch, kv_head, group,
                     num_heads, q_block_start, n_q_blocks, n_iter, seq_q, qk_scale, scale, bias_len,
                     mask_row_b, mask_row_h, dq_col0, zero_s, zero_dq, HAS_MASK: gl.constexpr,
                     STAGGER: gl.constexpr):
        """Iteration `it` of consumer WG's loop (_consumer): the j-th query block the GQA group's head g
        visits, `block` (from q_block_start; the next head's or this head's next one is `next_block`) with
        STAGGER, else block j; its products against this warpgroup's keys, dK and dV added to, dQ added into
        dq_desc's buffer. Returns dK, dV and the next iteration's query statistics."""
        dtype: gl.constexpr = q_bufs.dtype
        BLOCK_M: gl.constexpr = q_bufs.type.shape[3]
        HEAD_DIM: gl.constexpr = q_bufs.type.shape[4]
        KEYS: gl.constexpr = k_smem.type.shape[0]
        STAGES: gl.constexpr = q_bufs.type.shape[0]
        DQ_SPLIT: gl.constexpr = HEAD_DIM >= 128  # (_consumer's comment)
        col_layout: gl.constexpr = gl.SliceLayout(0, zero_s.type.layout)  # one value per query
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
        head = kv_head * group + g
        if not STAGGER:
            block = j
        m0 = (q_block_start + block) * BLOCK_M
        stage = it % STAGES
        phase = (it // STAGES) & 1
        q_smem = q_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
        do_smem = do_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
        lse = gl.convert_layout(lse_ahead, col_layout)
        delta = gl.convert_layout(delta_ahead, col_layout)
        # the next iteration's (the next head's first block after this head's last), whose load then has
        # this iteration to arrive
        head_ends = j + 1 == n_q_blocks
        if STAGGER:
            next_start = q_block_start + next_block
        else:
            next_start = gl.where(head_ends, q_block_start, q_block_start + j + 1)
        lse_ahead, delta_ahead = _query_stats(LSE, DELTA, first_row + g + head_ends.to(gl.int32), seq_q,
                                              next_start * BLOCK_M + stat_cols, it + 1 < n_iter)
        # The products start from -lse / qk_scale and -delta instead of zero, so that
        #     P^T = exp2(S^T qk_scale),  dS^T = P^T dP^T
        # and the two vectors (in wgmma's layout BLOCK_M / 4 registers each) are dead before S^T and dP^T
        # arrive: BLOCK_M 128 at head_dim 64 spilled 500 bytes with them live (now 180), and with the
        # load ahead this measured 1.10-1.31x the kernel that subtracted them
        # (bench/logs/attention_gluon_bwd_acc_init_s30_h200.log). The causal mask is S^T's -inf start
        # (wgmma adds finite products to it) on the blocks that cross the diagonal. qk_scale > 0: the
        # launcher checks it.
        s_start = gl.broadcast(gl.expand_dims(-(lse / qk_scale), 0), zero_s)[0]
        if CAUSAL:
            if m0 < first_key + KEYS:  # the block has queries before some of these keys
                queries = m0 + gl.arange(0, BLOCK_M, layout=col_layout)
                s_start = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(queries, 0), s_start,
                                   float("-inf"))
        dp_start = gl.broadcast(gl.expand_dims(-delta, 0), zero_s)[0]
        mbarrier.wait(q_ready.index(stage), phase)
        s_tok = warpgroup_mma(k_smem, q_smem.permute((1, 0)), s_start, is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        dp_tok = warpgroup_mma(v_smem, do_smem.permute((1, 0)), dp_start, is_async=True)
        if HAS_MASK:  # the padding mask's bias of these keys for this head (base 2, -inf past seq_k)
            bias_row = BIAS + (batch * mask_row_b + head * mask_row_h).to(gl.int64) * bias_len
            bias = gl.load(bias_row + keys)

        s, _, _ = warpgroup_mma_wait(1, deps=(s_tok, k_smem, q_smem))
        if HAS_MASK:
            p = gl.exp2(s * qk_scale + gl.expand_dims(bias, 1))
        else:
            p = gl.exp2(s * qk_scale)
        # dV's product goes out before dP is waited for
        dv_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), op_layout), do_smem, dv, is_async=True)
        dp, _, _ = warpgroup_mma_wait(1, deps=(dp_tok, v_smem, do_smem))
        ds = (p * dp).to(dtype)
        ds_op = gl.convert_layout(ds, op_layout)
        dk_tok = warpgroup_mma(ds_op, q_smem, dk, is_async=True)

        # dS^T to shared memory: dQ needs both warpgroups' key rows. Two buffers, so that one
        # warpgroup can store the next block's while the other still reads this one's.
        buf = it % 2
        ds_phase = (it // 2) & 1
        mbarrier.wait(ds_empty.index(buf), ds_phase ^ 1)
        ds_bufs.index(2 * buf + WG).store(ds)
        fence_async_shared()
        gl.thread_barrier()  # every thread's part is stored before the arrive (thread 0's) says so
        mbarrier.arrive(ds_ready.index(buf), count=1)
        mbarrier.wait(ds_ready.index(buf), ds_phase)
        if DQ_SPLIT:
            computes_dq = True
        else:
            computes_dq = it % 2 == WG
        if computes_dq:  # queued behind dV and dK
            ds0 = ds_bufs.index(2 * buf).permute((1, 0))  # dS of warpgroup 0's keys, (BLOCK_M, KEYS)
            ds1 = ds_bufs.index(2 * buf + 1).permute((1, 0))
            dq_tok = warpgroup_mma(ds0, k0_cols, zero_dq, use_acc=False, is_async=True)
            dq_tok = warpgroup_mma(ds1, k1_cols, dq_tok, is_async=True)
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
        else:
            dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
            dq = zero_dq
        mbarrier.arrive(q_empty.index(stage), count=1)
        mbarrier.arrive(do_empty.index(stage), count=1)
        mbarrier.arrive(ds_empty.index(buf), count=1)
        if computes_dq:
            # dQ leaves through shared memory by TMA reduce-add (rows past seq_q clipped); the previous
            # one has had an iteration to read its tile
            tma.store_wait(0)
            dq_smem.store(dq * scale)
            fence_async_shared()
            gl.thread_barrier()
            _tma_add_shared_to_global(dq_desc, [batch * num_heads + head, m0, dq_col0],
                                      dq_tiles.index(WG))
        return dk, dv, lse_ahead, delta_ahead

    @gluon.jit
    def _consumer(WG: gl.constexpr, dk_desc, dv_desc, dq_desc, q_bufs, do_bufs, k_tiles, v_tiles, ds_bufs,
                  dq_tiles, q_ready, q_empty, do_ready, do_empty, kv_bar, ds_ready, ds_empty, LSE, DELTA,
                  BIAS, batch, kv_head, group, num_heads, n0, q_block_start, n_q_blocks, first_block, seq_q,
                  qk_scale, scale, bias_len, mask_row_b, mask_row_h, CAUSAL: gl.constexpr,
                  HAS_MASK: gl.constexpr, STAGGER: gl.constexpr):
        """Consumer warpgroup WG: keys n0 + WG * KEYS onwards."""
        dtype: gl.constexpr = q_bufs.dtype
        BLOCK_M: gl.constexpr = q_bufs.type.shape[3]  # q_bufs: [STAGES, 1, 1, BLOCK_M, HEAD_DIM]
        HEAD_DIM: gl.constexpr = q_bufs.type.shape[4]
        KEYS: gl.constexpr = k_tiles.type.shape[3]  # k_tiles: [2, 1, 1, KEYS, HEAD_DIM]
        # head_dim >= 128: each warpgroup computes dQ for one half of head_dim every iteration; at 64 the
        # half (32 columns) is narrower than shared memory's 128-byte swizzle, so the warpgroups take turns
        # and compute all of dQ every other iteration
        DQ_SPLIT: gl.constexpr = HEAD_DIM >= 128
        DQ_COLS: gl.constexpr = HEAD_DIM // 2 if DQ_SPLIT else HEAD_DIM
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_COLS, 16])
        # the query statistics as they are loaded, an iteration ahead: one value a thread, where wgmma's
        # layout of a query vector (S^T's columns) holds BLOCK_M / 4 (32 registers a vector at BLOCK_M 128)
        stat_layout: gl.constexpr = STAT_LAYOUT

        first_key = n0 + WG * KEYS
        keys = first_key + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
        k_smem = k_tiles.index(WG).reshape([KEYS, HEAD_DIM])
        v_smem = v_tiles.index(WG).reshape([KEYS, HEAD_DIM])
        # dQ's B operands: the columns this warpgroup computes, of both warpgroups' K rows
        if DQ_SPLIT:
            k0_cols = k_tiles.index(0).reshape([KEYS, HEAD_DIM]).slice(WG * DQ_COLS, DQ_COLS, dim=1)
            k1_cols = k_tiles.index(1).reshape([KEYS, HEAD_DIM]).slice(WG * DQ_COLS, DQ_COLS, dim=1)
        else:
            k0_cols = k_tiles.index(0).reshape([KEYS, HEAD_DIM])
            k1_cols = k_tiles.index(1).reshape([KEYS, HEAD_DIM])
        dq_smem = dq_tiles.index(WG).reshape([BLOCK_M, DQ_COLS])
        dq_col0 = WG * DQ_COLS if DQ_SPLIT else 0
        zero_s = gl.full([KEYS, BLOCK_M], 0.0, gl.float32, s_layout)
        zero_dq = gl.full([BLOCK_M, DQ_COLS], 0.0, gl.float32, dq_layout)
        dk = gl.full([KEYS, HEAD_DIM], 0.0, gl.float32, kv_layout)
        dv = gl.full([KEYS, HEAD_DIM], 0.0, gl.float32, kv_layout)
        mbarrier.wait(kv_bar, 0)

        n_iter = group * n_q_blocks
        first_row = batch * num_heads + kv_head * group  # of LSE / DELTA: the group's first query head
        stat_cols = gl.arange(0, BLOCK_M, layout=stat_layout)
        if STAGGER:
            lse_ahead, delta_ahead = _query_stats(LSE, DELTA, first_row, seq_q,
                                                  (q_block_start + first_block) * BLOCK_M + stat_cols,
                                                  n_iter > 0)
        else:
            lse_ahead, delta_ahead = _block_stats(LSE, DELTA, 0, n_iter, first_row, q_block_start,
                                                  n_q_blocks, seq_q, BLOCK_M, stat_cols)
        # Iteration `it` = g * n_q_blocks + j: the GQA group's head g, the j-th of its query blocks, which
        # run from first_block round to the one before it (the rings' stages and phases count iterations).
        # Two loops rather than one over `it`, so that no iteration divides by n_q_blocks (the head and the
        # block of `it` and of the next one): 1.03-1.11x the kernel that did
        # (bench/logs/attention_bwd_peel_s33_h200.log). The causal diagonal's blocks in a loop of their
        # own and the rest without the masking code (as the forward does: two copies of the body) measured
        # 0.92-0.96x (attention_bwd_peel_causal_s33_h200.log).
        for g in range(group):
            block = first_block  # (STAGGER's; without it _query_block takes block j, in order)
            for j in range(n_q_blocks):
                next_block = block
                if STAGGER:
                    next_block = gl.where(block + 1 == n_q_blocks, 0, block + 1)
                dk, dv, lse_ahead, delta_ahead = _query_block(
                    WG, g * n_q_blocks + j, g, j, block, next_block, CAUSAL, dk, dv, lse_ahead, delta_ahead,
                    dq_desc, q_bufs, do_bufs, k_smem, v_smem, k0_cols, k1_cols, ds_bufs, dq_smem, dq_tiles,
                    q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty, LSE, DELTA, BIAS, keys,
                    first_key, stat_cols, first_row, batch, kv_head, group, num_heads, q_block_start,
                    n_q_blocks, n_iter, seq_q, qk_scale, scale, bias_len, mask_row_b, mask_row_h, dq_col0,
                    zero_s, zero_dq, HAS_MASK, STAGGER)
                if STAGGER:
                    block = next_block

        # dV leaves through this warpgroup's V tile (no one else reads it); TMA clips keys past seq_k
        v_smem.store(dv.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dv_desc, [batch, kv_head, first_key, 0], v_tiles.index(WG))
        # dK through the K tile, which both warpgroups' dQ products read: wait for the last one
        if n_iter > 0:
            last = n_iter - 1
            mbarrier.wait(ds_empty.index(last % 2), (last // 2) & 1)
        k_smem.store((dk * scale).to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [batch, kv_head, first_key, 0], k_tiles.index(WG))
        tma.store_wait(0)

    # rows_per_group not specialised: see attention_fwd_hopper's kernel
    @gluon.jit(do_not_specialize=["rows_per_group"])
    def _attention_bwd_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, DELTA,
                                     BIAS, KEY_RANGE, seq_q, num_heads, group, qk_scale, scale, bias_len,
                                     mask_row_b, mask_row_h, rows_per_group, STAGES: gl.constexpr,
                                     CAUSAL: gl.constexpr, HAS_MASK: gl.constexpr, STAGGER: gl.constexpr,
                                     PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        """HAS_MASK: a padding mask as the forward takes it (attention_fwd_hopper.padding_mask_args: bias
        rows and live key ranges), not with CAUSAL. STAGGER: _first_block's, not with CAUSAL."""
        gl.static_assert(not (HAS_MASK and CAUSAL), "a padding mask runs without causal masking")
        gl.static_assert(not (STAGGER and CAUSAL), "causal CTAs start at their diagonal")
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        KEYS: gl.constexpr = k_desc.block_type.shape[2]
        n0, batch, kv_head, q_block_start, n_q_blocks = _key_block(2 * KEYS, num_heads, group, seq_q, BLOCK_M,
                                                                   CAUSAL, rows_per_group)
        if HAS_MASK:
            # Keys outside every group head's live range get dK = dV = 0 and add nothing to dQ (p = 0 for
            # every query): such a CTA visits no query block and only writes its zeros.
            live_heads = 0
            for g in range(group):
                key_range = KEY_RANGE + 2 * (batch * mask_row_b + (kv_head * group + g) * mask_row_h)
                live = (n0 < gl.load(key_range + 1)) & (n0 + 2 * KEYS > gl.load(key_range))
                live_heads += live.to(gl.int32)
            if live_heads == 0:
                n_q_blocks = 0
        first_block = _first_block(n0 // (2 * KEYS), n_q_blocks, STAGGER)

        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape,
                                            do_desc.layout)
        k_tiles = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_tiles = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, BLOCK_M], q_desc.dtype)
        # dS^T tiles, indexed [buffer * 2 + warpgroup]
        ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [4, KEYS, BLOCK_M], ds_layout)
        dq_tiles = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # both consumers read every query block
            mbarrier.init(do_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)
            mbarrier.init(ds_empty.index(i), count=2)
        mbarrier.init(kv_bar, count=1)

        # argument tuples written in the call (a tuple in a variable turns its constexprs into tensors)
        gl.warp_specialize([
            (_consumer, (0, dk_desc, dv_desc, dq_desc, q_bufs, do_bufs, k_tiles, v_tiles, ds_bufs, dq_tiles,
                         q_ready, q_empty, do_ready, do_empty, kv_bar, ds_ready, ds_empty, LSE, DELTA, BIAS,
                         batch, kv_head, group, num_heads, n0, q_block_start, n_q_blocks, first_block, seq_q,
                         qk_scale, scale, bias_len, mask_row_b, mask_row_h, CAUSAL, HAS_MASK, STAGGER)),
            (_consumer, (1, dk_desc, dv_desc, dq_desc, q_bufs, do_bufs, k_tiles, v_tiles, ds_bufs, dq_tiles,
                         q_ready, q_empty, do_ready, do_empty, kv_bar, ds_ready, ds_empty, LSE, DELTA, BIAS,
                         batch, kv_head, group, num_heads, n0, q_block_start, n_q_blocks, first_block, seq_q,
                         qk_scale, scale, bias_len, mask_row_b, mask_row_h, CAUSAL, HAS_MASK, STAGGER)),
            (_producer, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_tiles, v_tiles, q_ready, q_empty,
                         do_ready, do_empty, kv_bar, batch, kv_head, group, n0, q_block_start, n_q_blocks,
                         first_block, STAGGER)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------------------------------------------- host


def hopper_backward_supported(q, k, v, attn_mask, dropout_p, window_left, window_right, bottom_right,
                              deterministic, compute_dbias=False) -> bool:
    """Whether the Gluon backward computes this call (else the Triton backward does): what the Gluon forward
    needs of a call (plain_attention_case), head_dim 64 / 128 / 256 (a padding mask at 64 / 128, and not when
    its gradient is wanted: compute_dbias), causal head_dim 64 from MIN_SEQ_Q_CAUSAL_64 query rows, and not
    under deterministic algorithms (dQ's additions come in any order)."""
    B, Hkv, Sq, D = k.shape[0], k.shape[1], q.shape[2], q.shape[3]
    if deterministic or not GLUON_AVAILABLE:
        return False
    if attn_mask is not None and (compute_dbias or not any(D == d for d in CONFIGS)):
        return False
    if not plain_attention_case(q, k, v, attn_mask, dropout_p, window_left, window_right, bottom_right,
                                B * Hkv):
        return False
    if window_right == 0 and D == 64 and Sq < MIN_SEQ_Q_CAUSAL_64:
        return False
    # compared, not hashed: under dynamic shapes D may be a SymInt
    return any(D == d for d in HEAD_DIMS) and sm90_tma_inputs(q, k, v)


def _dq_columns(head_dim: int) -> int:
    """Columns of dQ one warpgroup computes at a time (the kernel's DQ_COLS)."""
    return head_dim // 2 if head_dim >= 128 else head_dim


@functools.cache
def _dq_tile(block_m: int, head_dim: int):
    block = [1, block_m, _dq_columns(head_dim)]
    return block, gl.NVMMASharedLayout.get_default_for(block, gl.float32)


def compile_sm90(head_dim: int, dtype: str, causal: bool, config=None, mask: bool = False,
                 stagger: bool = False):
    """The kernel compiled ahead of time for sm_90, no GPU needed (the CPU tests' check of it); mask: the
    padding-mask variant (head_dim 64 / 128); stagger: _first_block's (head_dim 64 / 128, not causal)."""
    if head_dim == 256:
        if mask:
            raise ValueError("compile_sm90: the head_dim 256 backward takes no padding mask")
        from flash_backend.kernels import attention_bwd_hopper_256

        return attention_bwd_hopper_256.compile_sm90(dtype, causal,
                                                     config=config or attention_bwd_hopper_256.CONFIG)
    block_m, stages = config or CONFIGS[head_dim]  # (SHORT_SEQ_Q_CONFIG_64 compiles the same code)
    tiles = [("q_desc", block_m, head_dim), ("k_desc", KEYS_PER_CONSUMER, head_dim),
             ("v_desc", KEYS_PER_CONSUMER, head_dim), ("do_desc", block_m, head_dim),
             ("dk_desc", KEYS_PER_CONSUMER, head_dim), ("dv_desc", KEYS_PER_CONSUMER, head_dim)]
    return compile_gluon_bwd_sm90(_attention_bwd_hopper_kernel, dtype, tiles, _dq_tile(block_m, head_dim),
                                  dict(STAGES=stages, CAUSAL=causal, HAS_MASK=mask, STAGGER=stagger))


def compile_gluon_bwd_sm90(kernel, dtype: str, tiles, dq_tile, constexprs: dict):
    """A Gluon backward (this one or the head_dim 256 one) compiled for sm_90 without a GPU: its bf16 / fp16
    descriptors given as (name, rows, cols) tiles, the fp32 dQ descriptor's (block, layout), the scalar
    arguments both kernels take, and their constexprs plus this module's register budget."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    signature = {}
    for name, rows, cols in tiles:
        block, layout = _tile(rows, cols, torch_dtype)
        signature[name] = f"tensordesc<{dtype}{block},{layout!r}>"
    block, layout = dq_tile
    signature["dq_desc"] = f"tensordesc<fp32{block},{layout!r}>"
    signature.update(LSE="*fp32", DELTA="*fp32", seq_q="i32", num_heads="i32", group="i32",
                     qk_scale="fp32", scale="fp32", rows_per_group="i32")
    # the padding-mask arguments, of the kernels that have them (padding_mask_args)
    signature.update(BIAS="*fp32", KEY_RANGE="*i32", bias_len="i32", mask_row_b="i32", mask_row_h="i32")
    constexprs = dict(constexprs, PRODUCER_REGS=_PRODUCER_REGS, CONSUMER_REGS=_CONSUMER_REGS)
    signature.update({name: "constexpr" for name in constexprs})
    signature = {name: signature[name] for name in kernel.arg_names}  # in the kernel's order
    src = GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    options = {"num_warps": 4, "maxnreg": _MAXNREG}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def attention_backward_hopper_launch(dout, q, k, v, out, lse, scale, causal, dq, dk, dv, config=None,
                                     attn_mask=None, rows_per_group=None):
    """Fill dq, dk, dv with the Gluon backward; the caller checked hopper_backward_supported(...). dk / dv
    must be TMA-compatible (torch.empty_like of k / v is); dout, out and lse may have any strides; attn_mask
    None or a padding mask (attention_fwd_hopper.padding_mask_ok), not at head_dim 256; rows_per_group: the
    launch order's (attention_fwd_hopper._heaviest_first; heaviest_first_rows's when None)."""
    from flash_backend.kernels.attention_bwd import _attention_bwd_preprocess_kernel

    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if not scale > 0:
        raise ValueError(f"attention_backward_hopper_launch: scale must be > 0 (the products start from "
                         f"-logsumexp / scale), got {scale}")
    if B * H * Sq == 0 or Sk == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return
    if not (_tma_ok(dk) and _tma_ok(dv)):
        raise ValueError("attention_backward_hopper_launch: dk and dv need TMA-compatible strides")
    if not _tma_ok(dout):
        dout = dout.contiguous()
    lse = lse.contiguous()  # the kernel indexes it as (B * H, Sq); the forward's already is
    delta = torch.empty((B * H, Sq), dtype=torch.float32, device=q.device)
    fast_kernel(_attention_bwd_preprocess_kernel)[(cdiv(Sq, 64), B * H)](
        out, dout, delta, *out.stride(), *dout.stride(), H, Sq, HEAD_DIM=D,
        BLOCK_D=max(next_power_of_2(D), 16), BLOCK_M=64, BH_ON_X=False, num_warps=4,  # B * H <= MAX_GRID_Y
    )
    dq_acc = torch.zeros((B * H, Sq, D), dtype=torch.float32, device=q.device)
    if D == 256:
        from flash_backend.kernels import attention_bwd_hopper_256

        if attn_mask is not None:
            raise ValueError("attention_backward_hopper_launch: no padding mask at head_dim 256")
        attention_bwd_hopper_256.launch(q, k, v, dout, dk, dv, dq_acc, lse, delta, scale, causal,
                                        config=config or attention_bwd_hopper_256.CONFIG,
                                        rows_per_group=rows_per_group)
    else:
        block_m, stages = config or (SHORT_SEQ_Q_CONFIG_64 if D == 64 and Sq < SHORT_SEQ_Q else CONFIGS[D])
        dq_desc = TensorDescriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), *_dq_tile(block_m, D))
        bias, key_ranges, _, mask_ints, has_mask = padding_mask_args(attn_mask, Sk, lse)
        grid = (cdiv(Sk, BLOCK_N), B * Hkv)
        if rows_per_group is None:
            rows_per_group = heaviest_first_rows(*grid, causal, q.device, HEAVIEST_FIRST_WAVES)
        fast_kernel(_attention_bwd_hopper_kernel)[grid](
            _descriptor(q, block_m), _descriptor(k, KEYS_PER_CONSUMER), _descriptor(v, KEYS_PER_CONSUMER),
            _descriptor(dout, block_m), _descriptor(dk, KEYS_PER_CONSUMER),
            _descriptor(dv, KEYS_PER_CONSUMER), dq_desc, lse, delta, bias, key_ranges, Sq, H, H // Hkv,
            scale * LOG2E, scale, *mask_ints, rows_per_group, STAGES=stages, CAUSAL=causal, HAS_MASK=has_mask,
            STAGGER=not causal and Sk >= STAGGER_MIN_SEQ_K, PRODUCER_REGS=_PRODUCER_REGS,
            CONSUMER_REGS=_CONSUMER_REGS, num_warps=4, maxnreg=_MAXNREG,
        )
    dq.copy_(dq_acc.view(B, H, Sq, D))
