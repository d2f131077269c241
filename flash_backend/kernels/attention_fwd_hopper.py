"""Attention forward for Hopper (sm_90) in Gluon: FlashAttention-3's structure, for the plain cases.

Why a second forward: our Triton forward (kernels/attention_fwd.py) reaches 0.72-0.89x cuDNN on the H200,
and what separates it from cuDNN is a structure the Triton compiler does not generate for sm_90 (session 20,
bench/NOTES_attention.md). Gluon, Triton's explicit-layout language, exposes that structure directly:

- warp specialisation (gl.warp_specialize): a producer warp streams K and V tiles into a STAGES-deep ring of
  shared memory with TMA, each buffer guarded by a ready and an empty mbarrier, while two (or three)
  consumer warpgroups compute; registers are moved to the consumers (setmaxnreg: 240 each of two, 24 for
  the producer);
- in each consumer (64 query rows, wgmma's M per warpgroup), asynchronous wgmma: S_j = Q K_j^T and
  O += P_{j-1} V_{j-1} are issued together, the softmax of S_j runs while the P V product still does,
  and O is rescaled once that product is waited for (FA3's intra-warpgroup overlap);
- optionally "ping-pong" (FA3's inter-warpgroup schedule): the consumers issue their wgmmas in turns, so
  one's softmax overlaps another's matrix products.
- optionally persistent CTAs (head_dim 128 non-causal up to 2048 query rows: PERSISTENT_MAX_SEQ_Q_128): one
  CTA an SM takes every sm_count-th tile, its ring and ping-pong running on across tiles, so that a tile's
  output and the next tile's first loads overlap.
bench/attention_gluon_probe.py measured it (bench/logs/attention_gluon_probe*_h200.log) at 0.92-0.98x
cuDNN and 1.16-1.21x our Triton forward at head_dim 128, 0.98-1.02x cuDNN at 256, and with three consumers
0.94-0.98x at 64 non-causal; causal head_dim 64 beats the Triton forward from 4096 query rows (session 25),
from 2048 with the FMA softmax (session 30).

Scope (`hopper_forward_supported` decides; everything else runs kernels/attention_fwd.py): fp16 / bf16,
(head_dim, causal) in CONFIGS, no mask but a padding one (one row of keys per (batch, head), bool or
additive, not with causal masking: the CTA visits only the key blocks of the row's live range and adds its
bias, prepared by padding_mask_args), no dropout, no window, causal only top-left (or bottom-right
with Sq == Sk, the same thing), q / k / v / out with a contiguous last dim and 16-byte aligned strides
(TMA), any lengths (rows past a sequence end are zero-filled by TMA loads and clipped by TMA stores), GQA by
head mapping. It writes the same out and natural-log logsumexp as the Triton forward, so the backward is
shared.
"""

from __future__ import annotations

import functools

import torch
import triton

from flash_backend._device import device_index, sm_count
from flash_backend._fast_launch import fast_kernel
from flash_backend._host_math import cdiv
from flash_backend.kernels.attention_fwd import mask_is_query_broadcast, mask_key_ranges

try:  # Gluon's Hopper API (Triton >= 3.5); without it every call takes the Triton forward
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    GLUON_AVAILABLE = False

LOG2E = 1.4426950408889634
BLOCK_M = 64  # query rows per consumer warpgroup: wgmma's M for one warpgroup
MAX_GRID_Y = 65535  # B * H programs along the grid's second axis
# Smaller problems keep the Triton forward. An eager call of this kernel costs more host time (four TMA
# descriptors, Gluon's launcher), and at bench_attention's small rows the eager step is host-bound: ViT-base's
# 64 x 12 x 197^2 scores (3e7) ran at 0.74x the Triton forward's TFLOP/s, 16 x 16 x 1024^2 at head_dim 64 at
# 0.91x (bench/logs/bench_attention_hopper_376b0bc_h200.log).
MIN_SCORES = 1 << 28  # B * H * Sq * Sk
# Three consumers cover 192 query rows a CTA: at Sq = 1024 the last CTA of a head is two thirds empty.
MIN_SEQ_Q_THREE_CONSUMERS = 2048
# Head_dim 64 causal: with each warpgroup skipping the key blocks past its own rows (session 25), 1.07x /
# 1.17x the Triton forward at Sq = 4096 / 8192, 0.97x at 2048
# (bench/logs/attention_gluon_causal_skip_s25_h200.log); with the FMA softmax (RAW_SCORES) 1.16x / 1.07x at
# 4096 / 2048, 0.88x at 1024 (kernels alone, bench/logs/attention_causal64_routing_s30_h200.log).
MIN_SEQ_Q_CAUSAL_64 = 2048
# (BLOCK_N, STAGES, PINGPONG, CONSUMERS, RAW_SCORES) per (head_dim, causal) routed here: the fastest of
# bench/attention_gluon_probe.py's configurations, where it beat the Triton forward on the H200
# (bench/logs/attention_gluon_probe*_h200.log): head_dim 128 1.16-1.21x, 256 1.29-1.32x, 64 non-causal with
# three consumers (192 rows a CTA, as FA3) 1.06-1.10x; 64 causal with three consumers, no ping-pong (above).
# RAW_SCORES (the FMA softmax, _block_scores): head_dim 64 causal 1.05-1.09x the kernel without it (4,16,4096,
# 8,16,4096, 2,16,8192), twice (bench/logs/attention_gluon_fwd_fma_softmax_s29_h200.log, _shipped_s29_h200
# .log). Non-causal it lost while the last block's masking sat inside the key loop (ptxas made it selects on
# every block: head_dim 64 0.91-0.93x); with that block peeled (session 32, _consumer_blocks) it gains
# 1.06-1.11x at head_dim 64, 1.00-1.03x at 128, 1.02x at 256 over the peeled kernel without it
# (bench/logs/attention_fwd_peel_s32_h200.log; the shipped pair against the kernel before both:
# attention_fwd_peel_raw_s32_h200.log).
# A padding mask's forward keeps the scaled scores (routed_config): its loops keep their masking inside,
# where RAW_SCORES measured slower.
CONFIGS = {
    (64, False): (128, 2, True, 3, True),
    (64, True): (128, 2, False, 3, True),
    (128, False): (128, 2, True, 2, True),
    (128, True): (128, 2, True, 2, False),
    (256, False): (64, 2, False, 2, True),
    (256, True): (64, 2, False, 2, False),
}
# Persistent CTAs (a config's PERSISTENT: one CTA an SM, each taking every sm_count-th tile, the next tile's Q
# loading while this one's output is written) for head_dim 128 without causal masking or a mask, up to this
# many query rows. Kernels alone against the routed configuration (bench/probes/attention_fwd_persistent_
# probe.py, bench/logs/attention_fwd_persistent_s31_h200.log): 1.09x at 16,16,1024, 1.02x at 8,16,2048,
# 0.97-0.99x from 4096 rows (GQA too). Head_dim 64 keeps its three consumers (two persistent ones: 0.93x
# at 2048 rows, and three spill 268 bytes at their 160 registers).
PERSISTENT_MAX_SEQ_Q_128 = 2048
# The key loop with its last block peeled (_consumer_blocks) at head_dim 64 causal: 0.976-0.993x the loop
# with every block's masking inside, where head_dim 128 / 256 causal gained 1.00-1.04x (bench/probes/
# attention_fwd_peel_probe.py, bench/logs/attention_fwd_peel_s32_h200.log).
PEEL_CAUSAL_64 = triton.language.constexpr(False)
# A padding mask's pure rows (KEYS_RANGE, RANGE_LOOP_HEAD_DIMS) with a key loop free of masking code, as
# KEYS_PLAIN's (_consumer_blocks): the kernel branches once on the row's kind between two sets of
# partitions (a warp_specialize each: no consumer carries both key loops), a pure row's key blocks end at
# its last live key instead of a multiple of BLOCK_N (TMA loads from any row, zeros outside the tensor), so
# that only the first block, computed before the loop, holds dead keys; and the consumers' Q tiles load
# before the partitions. sm_90 SASS at head_dim 64 (tests/test_attention_hopper_padding.py): the pure rows'
# loop 598 -> 481 instructions (64 -> 0 FSEL; 419 with RAW_SCORES; the unmasked kernel's 513 / 451), no
# spills. Tried first (session 33, scratch): the last block peeled after the loop, as KEYS_PLAIN's, spilled
# inside the loop (120-184 bytes, 14-20 local loads / stores an iteration in the worker consumers, with
# one set of partitions or two); the range's edge blocks both before the loop spilled 88-128 bytes around
# them. False: session 27's kernel (one set of partitions, every block's masking inside the pure rows'
# loop).
PEEL_RANGE = triton.language.constexpr(True)
_PRODUCER_REGS = 24
_MASK_DTYPES = (torch.bool, torch.float16, torch.bfloat16, torch.float32)
_BIAS_BLOCK = 128  # a padding mask's bias rows are padded to whole blocks of this many keys
# How a consumer's key loop hides keys (_consumer_blocks' KEYS): past the sequence end and, causal, after the
# query (no mask); outside a pure padding row's live range [key_lo, key_hi); by adding the row's bias.
KEYS_PLAIN = triton.language.constexpr(0)
KEYS_RANGE = triton.language.constexpr(1)
KEYS_BIAS = triton.language.constexpr(2)
# Head_dims whose padding-mask forward gives pure rows a key loop of their own (KEYS_RANGE: no bias loads,
# only the range's edge blocks masked) beside the KEYS_BIAS loop. bench/probes/attention_padding_gluon_probe
# .py on the H200 (bench/logs/attention_padding_gluon_probe_s27*_h200.log), forward GPU time, bias loop for
# every row / both loops: head_dim 64 (8,16,2048, additive rows 3/4..1 long) 385 / 343 us, (4,16,4096)
# 652 / 588; head_dim 128 (8,16,2048) 483 / 552, (4,16,4096, bool rows 1/2..1 long) 696 / 806. The second
# loop doubles the consumers' code (head_dim 128: 57 -> 109 KB of SASS; 64: 91 KB unmasked, 146 with both).
RANGE_LOOP_HEAD_DIMS = (64, 128)
# Head_dims whose pure rows' loop takes the FMA softmax (RAW_SCORES) with a padding mask: where it was timed.
RAW_RANGE_HEAD_DIMS = (64,)
# Registers: the kernel's budget (maxnreg) is 65536 over its warps (the consumers' warpgroups and the
# producer's); setmaxnreg then moves them from the producer (24) to the consumers.
_REGS = {2: (168, 240), 3: (128, 160)}  # consumers: (maxnreg, registers a consumer thread)


if GLUON_AVAILABLE:

    @gluon.jit
    def _heaviest_first(rows_per_group):
        """(rank, row) of this CTA of a (blocks, rows) grid, for causal masking, where a row's blocks differ
        in work: rank 0 is the heaviest block of a row (the forward's last query block, the backward's first
        key block). CUDA starts CTAs roughly in launch order (x fastest), and the last ones decide when the
        kernel ends, so the launch order goes group by group of rows_per_group rows, and within a group
        rank by rank across its rows: the heavy CTAs start first and the light ones fill the tail.
        Bounded groups keep the CTAs that run together on a few rows, whose tensors L2 then holds.
        rows_per_group 1 is the plain order (rank = program_id(0), row = program_id(1)). Causal launches only:
        elsewhere the kernels keep the plain order, whose code this would change (spills in the padding
        forward at head_dim 64)."""
        blocks = gl.num_programs(0)
        linear = gl.program_id(1) * blocks + gl.program_id(0)
        first_row = linear // (rows_per_group * blocks) * rows_per_group
        group_rows = gl.minimum(rows_per_group, gl.num_programs(1) - first_row)  # the last group may be short
        in_group = linear - first_row * blocks
        rank = in_group // group_rows
        return rank, first_row + in_group - rank * group_rows

    @gluon.jit
    def _produce_blocks(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, batch, kv_head,
                        first_key, n_blocks, c0):
        """K and V of n_blocks key blocks from key first_key on (a multiple of BLOCK_N but for a pure padding
        row's under PEEL_RANGE) into the ring, c0 blocks after its start (the blocks of the earlier tiles of
        a persistent CTA; 0 otherwise)."""
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        for j in range(n_blocks):
            key0 = first_key + j * BLOCK_N
            stage = (c0 + j) % STAGES
            # a buffer's first use waits on parity 1, which a fresh mbarrier counts as complete
            empty_phase = (((c0 + j) // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(stage), empty_phase)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [batch, kv_head, key0, 0], k_ready.index(stage),
                                            k_bufs.index(stage))
            mbarrier.wait(v_empty.index(stage), empty_phase)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [batch, kv_head, key0, 0], v_ready.index(stage),
                                            v_bufs.index(stage))

    @gluon.jit
    def _producer(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, batch, kv_head,
                  first_key, n_blocks, group, num_heads, n_m_blocks, n_tiles, PERSISTENT: gl.constexpr):
        if PERSISTENT:  # every tile of this CTA (_tile_of), its blocks one after another in the ring
            for i in range(_n_local_tiles(n_tiles)):
                batch, head, pid_m = _tile_of(i, n_m_blocks, num_heads)
                _produce_blocks(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, batch,
                                head // group, 0, n_blocks, i * n_blocks)
        else:
            _produce_blocks(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, batch,
                            kv_head, first_key, n_blocks, 0)

    @gluon.jit
    def _n_local_tiles(n_tiles):
        """How many of the n_tiles tiles this persistent CTA computes: program_id, then every
        num_programs-th (the grid has at most n_tiles CTAs)."""
        return (n_tiles - gl.program_id(0) + gl.num_programs(0) - 1) // gl.num_programs(0)

    @gluon.jit
    def _tile_of(i, n_m_blocks, num_heads):
        """(batch, head, query block) of this persistent CTA's i-th tile: the query blocks of a (batch,
        head) are consecutive tiles, so the CTAs running together share a few heads' K and V in L2."""
        tile = gl.program_id(0) + i * gl.num_programs(0)
        bh = tile // n_m_blocks
        return bh // num_heads, bh % num_heads, tile - bh * n_m_blocks

    # Gluon's max / sum / zeros / cdiv are Triton's standard-library functions, which TRITON_INTERPRET=1 (how
    # CI runs the Triton kernels) turns into interpreter objects that Gluon cannot compile; the kernel uses
    # builtins only, so it compiles under that setting too.
    @gluon.jit
    def _max_fn(a, b):
        return gl.maximum(a, b)

    @gluon.jit
    def _add_fn(a, b):
        return a + b

    @gluon.jit
    def _wait_turn(turn_bars, WG: gl.constexpr, k, PINGPONG: gl.constexpr):
        """Ping-pong: the consumers issue their wgmmas in turns, round robin. Issue point k of consumer 0
        waits for the last consumer's point k - 1 (point 0 passes: a fresh mbarrier counts parity 1 as
        complete); consumer w > 0 waits for consumer w - 1's point k."""
        if PINGPONG:
            mbarrier.wait(turn_bars.index(WG), (k & 1) ^ (1 if WG == 0 else 0))

    @gluon.jit
    def _pass_turn(turn_bars, WG: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turn_bars.index((WG + 1) % turn_bars.type.shape[0]), count=1)

    @gluon.jit
    def _masked(s, j, n_blocks, rows, first_row, first_block, key_lo, key_hi, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr, KEYS: gl.constexpr, s_layout: gl.constexpr):
        """Block j's scores (key block first_block + j) with the keys outside [key_lo, key_hi) and, causal,
        the keys after the query set to -inf. Only the blocks that can hold such keys pay: the last (key_hi
        is the sequence end or a padding row's end), the first under KEYS_RANGE (key_lo, a padding row's
        first live key, may fall inside it; otherwise key_lo is 0), and, causal, those reaching past the
        warpgroup's first row."""
        needs_mask = j == n_blocks - 1
        if KEYS == KEYS_RANGE:
            needs_mask = needs_mask | (j == 0)
        if CAUSAL:
            needs_mask = needs_mask | ((j + 1) * BLOCK_N > first_row + 1)
        if needs_mask:
            cols = (first_block + j) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            in_range = cols < key_hi
            if KEYS == KEYS_RANGE:
                in_range = in_range & (cols >= key_lo)
            keep = gl.expand_dims(in_range, 0)
            if CAUSAL:
                keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
            s = gl.where(keep, s, float("-inf"))
        return s

    @gluon.jit
    def _block_bias(bias_row, block, BLOCK_N: gl.constexpr, KEYS: gl.constexpr, s_layout: gl.constexpr):
        """KEYS_BIAS: the prepared bias of key block `block` (base 2, -inf past seq_k, padded to whole
        blocks, so no bounds check), a [BLOCK_N] row of the score tile's columns, loaded while the block's
        S product runs; otherwise nothing."""
        if KEYS == KEYS_BIAS:
            keys = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            return gl.load(bias_row + keys)
        else:  # one return per (constexpr) branch: Gluon checks the returns of a branch it generates
            return 0.0

    # RAW (a config's RAW_SCORES, not with KEYS_BIAS): the scores stay unscaled through the masking, the
    # row max is taken of the raw products and scaled once a row, and exp2's argument s * qk_scale - m is one
    # FMA an element instead of a multiply and a subtraction (FlashAttention-3's softmax). max(s) * c is
    # max(s * c) only for c > 0: the launcher refuses other scales. Where the edge blocks' masking is cheap
    # enough for ptxas to turn its branch into selects on every block, that costs more than the multiply
    # saves: CONFIGS turns it on where it measured faster.
    @gluon.jit
    def _block_scores(s, bias, j, n_blocks, rows, first_row, first_block, key_lo, key_hi, qk_scale,
                      BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, KEYS: gl.constexpr, RAW: gl.constexpr,
                      EDGE: gl.constexpr, s_layout: gl.constexpr):
        """Block j's scores with what hides keys applied (module KEYS_* modes), -inf where hidden: in base
        2, or unscaled when RAW. EDGE False: a block between the edges of the keys, nothing hidden (no code
        for the masking at all; KEYS_BIAS still adds its bias)."""
        if KEYS == KEYS_BIAS:
            return s * qk_scale + gl.expand_dims(bias, 0)
        elif not EDGE:
            if RAW:
                return s
            else:
                return s * qk_scale
        elif RAW:
            return _masked(s, j, n_blocks, rows, first_row, first_block, key_lo, key_hi, BLOCK_N, CAUSAL,
                           KEYS, s_layout)
        else:
            return _masked(s * qk_scale, j, n_blocks, rows, first_row, first_block, key_lo, key_hi, BLOCK_N,
                           CAUSAL, KEYS, s_layout)

    @gluon.jit
    def _row_max(s, qk_scale, RAW: gl.constexpr):
        """The rows' max of _block_scores' block, in base 2."""
        if RAW:
            return gl.reduce(s, 1, _max_fn) * qk_scale
        else:
            return gl.reduce(s, 1, _max_fn)

    @gluon.jit
    def _exp2_shifted(s, m, qk_scale, RAW: gl.constexpr):
        """exp2 of _block_scores' block in base 2 minus the rows' m."""
        if RAW:
            return gl.exp2(s * qk_scale - gl.expand_dims(m, 1))
        else:
            return gl.exp2(s - gl.expand_dims(m, 1))

    @gluon.jit
    def _key_block(WG: gl.constexpr, j, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn_bars,
                   p_op, acc, m_i, l_i, rows, first_row, n_blocks, first_block, key_lo, key_hi, bias_row,
                   qk_scale, c0, k0, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, KEYS: gl.constexpr,
                   RAW: gl.constexpr, EDGE: gl.constexpr):
        """Key block j >= 1 of _consumer_blocks' loop: S_j = Q K_j^T issued with P_{j-1} V_{j-1}, S_j's
        online softmax while P V runs, then O rescaled. EDGE: the block may hold hidden keys (_block_scores
        masks it); (P_j in the A-operand layout, acc, m_i, l_i) carry on."""
        dtype: gl.constexpr = q_smem.dtype
        BLOCK_M: gl.constexpr = q_smem.type.shape[0]
        HEAD_DIM: gl.constexpr = q_smem.type.shape[1]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        stage = (c0 + j) % STAGES
        prev = (c0 + j - 1) % STAGES
        mbarrier.wait(k_ready.index(stage), ((c0 + j) // STAGES) & 1)
        k_smem = k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM])
        mbarrier.wait(v_ready.index(prev), ((c0 + j - 1) // STAGES) & 1)
        v_smem = v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM])
        _wait_turn(turn_bars, WG, k0 + j, PINGPONG)
        zero_s = gl.full([BLOCK_M, BLOCK_N], 0.0, gl.float32, s_layout)
        s_tok = warpgroup_mma(q_smem, k_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p_op, v_smem, acc, is_async=True)
        _pass_turn(turn_bars, WG, PINGPONG)
        bias = _block_bias(bias_row, first_block + j, BLOCK_N, KEYS, s_layout)
        # wgmma groups complete in issue order: one outstanding means S_j is done, P V may still run
        s, _, _ = warpgroup_mma_wait(1, deps=(s_tok, q_smem, k_smem))
        mbarrier.arrive(k_empty.index(stage), count=1)
        s = _block_scores(s, bias, j, n_blocks, rows, first_row, first_block, key_lo, key_hi, qk_scale,
                          BLOCK_N, CAUSAL, KEYS, RAW, EDGE, s_layout)
        m_new = gl.maximum(m_i, _row_max(s, qk_scale, RAW))
        alpha = gl.exp2(m_i - m_new)
        p = _exp2_shifted(s, m_new, qk_scale, RAW)
        l_i = l_i * alpha + gl.reduce(p, 1, _add_fn)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc, _ = warpgroup_mma_wait(0, deps=(o_tok, v_smem))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        return p_op, acc, m_new, l_i

    @gluon.jit
    def _consumer_blocks(WG: gl.constexpr, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                         turn_bars, rows, first_row, n_blocks, first_block, key_lo, key_hi, bias_row,
                         qk_scale, c0, k0, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, KEYS: gl.constexpr,
                         RAW_SCORES: gl.constexpr):
        """The key blocks of consumer WG's rows: (acc, m_i, l_i) of the online softmax, acc = unnormalised
        P V. KEYS (module KEYS_* modes) says how keys are hidden, a constexpr so that each mode compiles to
        a loop of its own (a runtime choice inside the loop spilled ~450 bytes at head_dim 64). RAW_SCORES:
        the FMA softmax (_block_scores). c0 / k0: the ring's blocks and the ping-pong's turns taken before
        (by a persistent CTA's earlier tiles; 0 otherwise)."""
        RAW: gl.constexpr = RAW_SCORES and KEYS != KEYS_BIAS
        dtype: gl.constexpr = q_smem.dtype
        BLOCK_M: gl.constexpr = q_smem.type.shape[0]
        HEAD_DIM: gl.constexpr = q_smem.type.shape[1]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[3]  # k_bufs: [STAGES, 1, 1, BLOCK_N, HEAD_DIM]
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        # Causal: the CTA's n_blocks reach its last row's keys; this warpgroup's rows see fewer. It computes
        # its own n_mine blocks and only releases the rest (the drain below): with three consumers of 64
        # rows and 128-key blocks, the first warpgroup skips one or two blocks a CTA.
        n_mine = n_blocks
        if CAUSAL:
            n_mine = gl.minimum(n_blocks, (first_row + BLOCK_M + BLOCK_N - 1) // BLOCK_N)
        zero_s = gl.full([BLOCK_M, BLOCK_N], 0.0, gl.float32, s_layout)

        # key block 0: S_0 and its softmax, before the overlapped loop
        k_smem = k_bufs.index(c0 % STAGES).reshape([BLOCK_N, HEAD_DIM])
        mbarrier.wait(k_ready.index(c0 % STAGES), (c0 // STAGES) & 1)
        _wait_turn(turn_bars, WG, k0, PINGPONG)
        s_tok = warpgroup_mma(q_smem, k_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        _pass_turn(turn_bars, WG, PINGPONG)
        bias = _block_bias(bias_row, first_block, BLOCK_N, KEYS, s_layout)
        s, _, _ = warpgroup_mma_wait(0, deps=(s_tok, q_smem, k_smem))
        mbarrier.arrive(k_empty.index(c0 % STAGES), count=1)
        s = _block_scores(s, bias, 0, n_blocks, rows, first_row, first_block, key_lo, key_hi, qk_scale,
                          BLOCK_N, CAUSAL, KEYS, RAW, True, s_layout)
        m_i = _row_max(s, qk_scale, RAW)
        if KEYS != KEYS_PLAIN:
            # The first block holds the padding row's first live key, live for every query row (the mask
            # broadcasts over them), so every row's max is finite from here on, except when the row has no
            # live key at all: then the kernel was given one block, every score -inf, and the max taken as
            # 0 keeps p = 0 (not NaN), l = 0, acc = 0 (_consumer then writes out = 0, logsumexp +inf).
            m_i = gl.where(m_i == float("-inf"), 0.0, m_i)
        p = _exp2_shifted(s, m_i, qk_scale, RAW)
        l_i = gl.reduce(p, 1, _add_fn)
        # P crosses the loop already in the wgmma A-operand layout and dtype: 32 registers a thread instead of
        # 64 in fp32 (carried in fp32, head_dim 128 spilled 280 bytes)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = gl.full([BLOCK_M, HEAD_DIM], 0.0, gl.float32, o_layout)

        # KEYS_PLAIN: only the last block can hold hidden keys (the sequence's end and, causal, the block
        # crossing the warpgroup's diagonal: the blocks before it lie wholly below the diagonal, the rows
        # being 64 and the blocks 64 or 128 keys wide), and the peeled first one. The loop runs the blocks
        # between with no masking code at all and the last block comes after it: with the masking inside
        # the loop, ptxas predicated its selects onto every block (64 FSEL and their predicates an
        # iteration at head_dim 64, 128 causal). The last block is a loop of zero or one trips, not an
        # `if`: an `if` merging the accumulators made ptxas serialize the wgmmas. KEYS_BIAS adds the bias on
        # every block: one loop; head_dim 64 causal too (PEEL_CAUSAL_64). KEYS_RANGE under PEEL_RANGE: the
        # blocks end at the row's last live key (the kernel's _specialize call), so that only the first
        # block, already out of the loop, can hold dead keys: no masking code in the loop at all.
        PEEL: gl.constexpr = KEYS == KEYS_PLAIN and (PEEL_CAUSAL_64 or not (CAUSAL and HEAD_DIM == 64))
        if KEYS == KEYS_RANGE and PEEL_RANGE:
            for j in range(1, n_mine):
                p_op, acc, m_i, l_i = _key_block(
                    WG, j, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn_bars, p_op, acc,
                    m_i, l_i, rows, first_row, n_blocks, first_block, key_lo, key_hi, bias_row, qk_scale, c0,
                    k0, CAUSAL, PINGPONG, KEYS, RAW, False)
        elif not PEEL:
            for j in range(1, n_mine):
                p_op, acc, m_i, l_i = _key_block(
                    WG, j, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn_bars, p_op, acc,
                    m_i, l_i, rows, first_row, n_blocks, first_block, key_lo, key_hi, bias_row, qk_scale, c0,
                    k0, CAUSAL, PINGPONG, KEYS, RAW, True)
        else:
            for j in range(1, n_mine - 1):
                p_op, acc, m_i, l_i = _key_block(
                    WG, j, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn_bars, p_op, acc,
                    m_i, l_i, rows, first_row, n_blocks, first_block, key_lo, key_hi, bias_row, qk_scale, c0,
                    k0, CAUSAL, PINGPONG, KEYS, RAW, False)
            for j in range(gl.maximum(n_mine - 1, 1), n_mine):  # the last block, if not the first
                p_op, acc, m_i, l_i = _key_block(
                    WG, j, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn_bars, p_op,
                    acc, m_i, l_i, rows, first_row, n_blocks, first_block, key_lo, key_hi, bias_row, qk_scale,
                    c0, k0, CAUSAL, PINGPONG, KEYS, RAW, True)

        last = c0 + n_mine - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        v_smem = v_bufs.index(last % STAGES).reshape([BLOCK_N, HEAD_DIM])
        _wait_turn(turn_bars, WG, k0 + n_mine, PINGPONG)
        o_tok = warpgroup_mma(p_op, v_smem, acc, is_async=True)
        _pass_turn(turn_bars, WG, PINGPONG)
        acc, _ = warpgroup_mma_wait(0, deps=(o_tok, v_smem))
        mbarrier.arrive(v_empty.index(last % STAGES), count=1)

        if CAUSAL:
            # Blocks past this warpgroup's rows: every consumer must release every K / V buffer (the empty
            # barriers count them all), and keep its place in the ping-pong round. A buffer is released
            # only once its fill has landed: an early arrival would count toward the previous fill's
            # release while another consumer still reads that one.
            for j in range(n_mine, n_blocks):
                stage = (c0 + j) % STAGES
                mbarrier.wait(k_ready.index(stage), ((c0 + j) // STAGES) & 1)
                mbarrier.arrive(k_empty.index(stage), count=1)
                mbarrier.wait(v_ready.index(stage), ((c0 + j) // STAGES) & 1)
                mbarrier.arrive(v_empty.index(stage), count=1)
                _wait_turn(turn_bars, WG, k0 + j + 1, PINGPONG)
                _pass_turn(turn_bars, WG, PINGPONG)
        return acc, m_i, l_i

    @gluon.jit
    def _write_rows(acc, m_i, l_i, out_tile, o_desc, LSE, batch, head, num_heads, first_row, rows, seq_q,
                    HAS_MASK: gl.constexpr):
        """A consumer's 64 finished rows: out = acc / l through out_tile by TMA (rows past seq_q clipped;
        the caller waits for the store before reusing the tile) and the natural-log logsumexp."""
        dtype: gl.constexpr = o_desc.dtype
        BLOCK_M: gl.constexpr = o_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = o_desc.block_type.shape[3]
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        if HAS_MASK:
            no_live_key = l_i == 0.0  # acc is 0 there: out = 0, logsumexp +inf (the module's convention)
            l_i = gl.where(no_live_key, 1.0, l_i)
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        out = (acc / gl.expand_dims(l_o, 1)).to(dtype)
        out_tile.reshape([BLOCK_M, HEAD_DIM]).store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [batch, head, first_row, 0], out_tile)
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # natural log, as the Triton forward writes it
        if HAS_MASK:
            lse = gl.where(no_live_key, float("inf"), lse)
        lse_offsets = (batch * num_heads + head).to(gl.int64) * seq_q + rows
        gl.store(LSE + lse_offsets, lse, mask=rows < seq_q)

    @gluon.jit
    def _consumer(WG: gl.constexpr, q_desc, o_desc, q_tiles, o_tiles, q_bars, k_bufs, v_bufs, k_ready,
                  k_empty, v_ready, v_empty, turn_bars, LSE, batch, head, num_heads, m0, seq_q, seq_k,
                  n_blocks, qk_scale, bias_row, pure, key_lo, first_block, n_m_blocks, n_tiles,
                  CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, HAS_MASK: gl.constexpr,
                  RANGE_LOOP: gl.constexpr, RAW_SCORES: gl.constexpr, PERSISTENT: gl.constexpr):
        """Consumer warpgroup WG: query rows m0 + WG * BLOCK_M onwards against key blocks first_block
        onwards (n_blocks of them), keys [key_lo, seq_k) live; with a padding mask (HAS_MASK) seq_k is its
        row's live end, bias_row its prepared bias row, and rows run the KEYS_BIAS loop, or with RANGE_LOOP
        a pure row (the range is the whole mask) the KEYS_RANGE one (RANGE_LOOP_HEAD_DIMS says where).
        PERSISTENT: the rows of every tile of the CTA instead (_consumer_tiles)."""
        if PERSISTENT:
            _consumer_tiles(WG, q_desc, o_desc, q_tiles, o_tiles, q_bars, k_bufs, v_bufs, k_ready, k_empty,
                            v_ready, v_empty, turn_bars, LSE, num_heads, seq_q, seq_k, n_blocks, qk_scale,
                            bias_row, n_m_blocks, n_tiles, PINGPONG, RAW_SCORES)
        else:
            q_tile = q_tiles.index(WG)
            q_bar = q_bars.index(WG)
            BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
            HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
            BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, BLOCK_N, 16])
            first_row = m0 + WG * BLOCK_M  # this warpgroup's first query row
            if not (RANGE_LOOP and PEEL_RANGE):  # else the kernel loaded Q before the partitions began
                mbarrier.expect(q_bar, q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [batch, head, first_row, 0], q_bar, q_tile)
            q_smem = q_tile.reshape([BLOCK_M, HEAD_DIM])
            rows = first_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            mbarrier.wait(q_bar, 0)

            if RANGE_LOOP and pure:  # RANGE_LOOP (a padding mask): pure rows take a loop that loads no bias
                acc, m_i, l_i = _consumer_blocks(WG, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready,
                                                 v_empty, turn_bars, rows, first_row, n_blocks, first_block,
                                                 key_lo, seq_k, bias_row, qk_scale, 0, 0, CAUSAL, PINGPONG,
                                                 KEYS_RANGE, RAW_SCORES)
            else:
                acc, m_i, l_i = _consumer_blocks(WG, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready,
                                                 v_empty, turn_bars, rows, first_row, n_blocks, first_block,
                                                 key_lo, seq_k, bias_row, qk_scale, 0, 0, CAUSAL, PINGPONG,
                                                 KEYS_BIAS if HAS_MASK else KEYS_PLAIN, RAW_SCORES)
            # Q's tile is free once the last S wgmma was waited for: the output leaves through it
            _write_rows(acc, m_i, l_i, q_tile, o_desc, LSE, batch, head, num_heads, first_row, rows, seq_q,
                        HAS_MASK)
            tma.store_wait(0)

    @gluon.jit
    def _consumer_tiles(WG: gl.constexpr, q_desc, o_desc, q_tiles, o_tiles, q_bars, k_bufs, v_bufs, k_ready,
                        k_empty, v_ready, v_empty, turn_bars, LSE, num_heads, seq_q, seq_k, n_blocks,
                        qk_scale, bias_row, n_m_blocks, n_tiles, PINGPONG: gl.constexpr,
                        RAW_SCORES: gl.constexpr):
        """A persistent CTA's consumer WG (no causal masking, no mask): its rows of every tile of the CTA
        (_tile_of), each against all n_blocks key blocks. The next tile's Q loads as soon as this tile's
        last S product is waited for, while the output is written through a tile of its own (o_tiles), so
        that one tile's output and the next one's first loads overlap (a CTA a tile pays both in turn)."""
        CONSUMERS: gl.constexpr = q_tiles.type.shape[0]
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        q_tile = q_tiles.index(WG)
        o_tile = o_tiles.index(WG)
        q_bar = q_bars.index(WG)
        q_smem = q_tile.reshape([BLOCK_M, HEAD_DIM])
        n_local = _n_local_tiles(n_tiles)
        batch, head, pid_m = _tile_of(0, n_m_blocks, num_heads)
        first_row = pid_m * (CONSUMERS * BLOCK_M) + WG * BLOCK_M
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [batch, head, first_row, 0], q_bar, q_tile)
        for i in range(n_local):
            rows = first_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            mbarrier.wait(q_bar, i & 1)
            acc, m_i, l_i = _consumer_blocks(WG, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                                             turn_bars, rows, first_row, n_blocks, 0, 0, seq_k, bias_row,
                                             qk_scale, i * n_blocks, i * (n_blocks + 1), False, PINGPONG,
                                             KEYS_PLAIN, RAW_SCORES)
            next_batch, next_head, next_pid_m = _tile_of(i + 1, n_m_blocks, num_heads)
            next_first_row = next_pid_m * (CONSUMERS * BLOCK_M) + WG * BLOCK_M
            if i + 1 < n_local:  # Q's tile is free: its last product was waited for
                mbarrier.expect(q_bar, q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [next_batch, next_head, next_first_row, 0], q_bar,
                                                q_tile)
            tma.store_wait(0)  # the previous tile's output has left o_tile
            _write_rows(acc, m_i, l_i, o_tile, o_desc, LSE, batch, head, num_heads, first_row, rows, seq_q,
                        False)
            batch = next_batch
            head = next_head
            first_row = next_first_row
        tma.store_wait(0)

    # rows_per_group is not specialised (Triton would compile one variant for 1, one for multiples of 16
    # and one for the rest): its value follows the shape, and a Gluon compile takes seconds
    @gluon.jit(do_not_specialize=["rows_per_group", "num_bh"])
    def _attention_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, LSE, BIAS, KEY_RANGE, PURE, seq_q,
                                     seq_k, num_heads, group, qk_scale, bias_len, mask_row_b, mask_row_h,
                                     rows_per_group, num_bh, CONSUMERS: gl.constexpr, STAGES: gl.constexpr,
                                     CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, HAS_MASK: gl.constexpr,
                                     RANGE_LOOP: gl.constexpr, RAW_SCORES: gl.constexpr,
                                     PERSISTENT: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                     CONSUMER_REGS: gl.constexpr):
        """HAS_MASK: a padding mask, given as its rows' bias (BIAS, bias_len keys a row), live key ranges
        (KEY_RANGE, (first, last + 1) a row) and pure flags (PURE), row batch * mask_row_b + head *
        mask_row_h (padding_mask_args): the CTA visits only the key blocks its row's range touches. Not
        with CAUSAL (a query row before the first live key would see none; the routing keeps those on the
        Triton forward)."""
        gl.static_assert(not (HAS_MASK and CAUSAL), "a padding mask runs without causal masking")
        gl.static_assert(HAS_MASK or not RANGE_LOOP, "RANGE_LOOP is a padding-mask variant")
        gl.static_assert(not (PERSISTENT and (CAUSAL or HAS_MASK)), "persistent: every tile the same work")
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        if CAUSAL:
            rank, bh = _heaviest_first(rows_per_group)
            pid_m = gl.num_programs(0) - 1 - rank  # rank 0: the last query block, which sees the most keys
        else:  # every block the same work (PERSISTENT: the partitions take their tiles from _tile_of)
            pid_m = gl.program_id(0)
            bh = gl.program_id(1)
        # PERSISTENT: tiles of CONSUMERS * BLOCK_M query rows of a (batch, head), num_bh of those
        n_m_blocks = (seq_q + CONSUMERS * BLOCK_M - 1) // (CONSUMERS * BLOCK_M)
        n_tiles = n_m_blocks * num_bh
        m0 = pid_m * (CONSUMERS * BLOCK_M)
        batch = bh // num_heads
        head = bh % num_heads
        first_block = 0
        if CAUSAL:
            n_blocks = (gl.minimum(seq_k, m0 + CONSUMERS * BLOCK_M) + BLOCK_N - 1) // BLOCK_N
        else:
            n_blocks = (seq_k + BLOCK_N - 1) // BLOCK_N
        mask_row = batch * mask_row_b + head * mask_row_h
        bias_row = BIAS + mask_row.to(gl.int64) * bias_len
        key_lo = 0
        pure = 0
        if HAS_MASK:
            key_lo = gl.load(KEY_RANGE + 2 * mask_row)
            seq_k = gl.load(KEY_RANGE + 2 * mask_row + 1)  # the row's live end: no key past it counts
            pure = gl.load(PURE + mask_row)
            first_block = key_lo // BLOCK_N
            # a row without live keys ((0, 0)) still takes one block: see _consumer_blocks' first block
            n_blocks = gl.maximum((seq_k + BLOCK_N - 1) // BLOCK_N - first_block, 1)

        q_block: gl.constexpr = q_desc.block_type.shape
        q_tiles = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_block, q_desc.layout)
        if PERSISTENT:  # the output leaves through tiles of its own while the next tile's Q loads
            o_tiles = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS] + q_block, o_desc.layout)
        else:  # through Q's
            o_tiles = q_tiles
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        turn_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(q_bars.index(i), count=1)
            mbarrier.init(turn_bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=CONSUMERS)  # every consumer reads every K / V tile
            mbarrier.init(v_empty.index(i), count=CONSUMERS)
        if RANGE_LOOP and PEEL_RANGE:
            # Every consumer's Q tile loads here, before the partitions: loaded in the worker consumers (as
            # elsewhere), the copy's operands were a 64-bit value that ptxas carried through the workers'
            # dispatch loop and spilled around each partition (8 bytes a worker consumer, 64-72 in all with
            # two sets of partitions; 32 in session 27's kernel, compiled as the runtime specialises it)
            fence_async_shared()
            for i in gl.static_range(CONSUMERS):
                mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [batch, head, m0 + i * BLOCK_M, 0], q_bars.index(i),
                                                q_tiles.index(i))
            # Pure rows and the others in partitions of their own (each consumer holds one key loop). A pure
            # row's n_pure blocks end at its live end seq_k (the first starts at first_key, before key 0
            # where the range is shorter than the blocks: TMA fills rows outside the tensor with zeros), so
            # that only the first block holds dead keys (_consumer_blocks); its keys are counted from
            # first_key there (key_lo - first_key the first live one). A row without a live key ((0, 0))
            # has one block, every key dead.
            n_pure = gl.maximum((seq_k - key_lo + BLOCK_N - 1) // BLOCK_N, 1)
            first_key = seq_k - n_pure * BLOCK_N
            if pure != 0:
                _specialize(q_desc, k_desc, v_desc, o_desc, LSE, q_tiles, o_tiles, k_bufs, v_bufs, q_bars,
                            turn_bars, k_ready, k_empty, v_ready, v_empty, batch, head, num_heads, group, m0,
                            seq_q, n_pure * BLOCK_N, n_pure, qk_scale, bias_row, True, key_lo - first_key, 0,
                            first_key, n_m_blocks, n_tiles, CONSUMERS, CAUSAL, PINGPONG, HAS_MASK,
                            RANGE_LOOP, RAW_SCORES, PERSISTENT, PRODUCER_REGS, CONSUMER_REGS)
            else:
                _specialize(q_desc, k_desc, v_desc, o_desc, LSE, q_tiles, o_tiles, k_bufs, v_bufs, q_bars,
                            turn_bars, k_ready, k_empty, v_ready, v_empty, batch, head, num_heads, group, m0,
                            seq_q, seq_k, n_blocks, qk_scale, bias_row, False, key_lo, first_block,
                            first_block * BLOCK_N, n_m_blocks, n_tiles, CONSUMERS, CAUSAL, PINGPONG, HAS_MASK,
                            RANGE_LOOP, RAW_SCORES, PERSISTENT, PRODUCER_REGS, CONSUMER_REGS)
        else:
            _specialize(q_desc, k_desc, v_desc, o_desc, LSE, q_tiles, o_tiles, k_bufs, v_bufs, q_bars,
                        turn_bars, k_ready, k_empty, v_ready, v_empty, batch, head, num_heads, group, m0,
                        seq_q, seq_k, n_blocks, qk_scale, bias_row, pure != 0, key_lo, first_block,
                        first_block * BLOCK_N, n_m_blocks, n_tiles, CONSUMERS, CAUSAL, PINGPONG, HAS_MASK,
                        RANGE_LOOP, RAW_SCORES, PERSISTENT, PRODUCER_REGS, CONSUMER_REGS)

    @gluon.jit
    def _specialize(q_desc, k_desc, v_desc, o_desc, LSE, q_tiles, o_tiles, k_bufs, v_bufs, q_bars,
                    turn_bars, k_ready, k_empty, v_ready, v_empty, batch, head, num_heads, group, m0, seq_q,
                    seq_k, n_blocks, qk_scale, bias_row, pure, key_lo, first_block, first_key, n_m_blocks,
                    n_tiles, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                    HAS_MASK: gl.constexpr, RANGE_LOOP: gl.constexpr, RAW_SCORES: gl.constexpr,
                    PERSISTENT: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        """The kernel's partitions: the consumers (_consumer) and the producer (_producer, its blocks from
        key first_key on). pure: whether the row is plain padding, at run time, or a constexpr where the
        kernel chose between two sets of partitions (PEEL_RANGE)."""
        # The argument tuples are written in the call: a tuple assigned to a variable first turns its
        # constexprs into tensors. Consumer 0 is the default partition (4 warps); the other consumers and
        # the producer are workers.
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_consumer, (0, q_desc, o_desc, q_tiles, o_tiles, q_bars, k_bufs, v_bufs, k_ready, k_empty,
                             v_ready, v_empty, turn_bars, LSE, batch, head, num_heads, m0, seq_q, seq_k,
                             n_blocks, qk_scale, bias_row, pure, key_lo, first_block, n_m_blocks,
                             n_tiles, CAUSAL, PINGPONG, HAS_MASK, RANGE_LOOP, RAW_SCORES, PERSISTENT)),
                (_consumer, (1, q_desc, o_desc, q_tiles, o_tiles, q_bars, k_bufs, v_bufs, k_ready, k_empty,
                             v_ready, v_empty, turn_bars, LSE, batch, head, num_heads, m0, seq_q, seq_k,
                             n_blocks, qk_scale, bias_row, pure, key_lo, first_block, n_m_blocks,
                             n_tiles, CAUSAL, PINGPONG, HAS_MASK, RANGE_LOOP, RAW_SCORES, PERSISTENT)),
                (_producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, batch,
                             head // group, first_key, n_blocks, group, num_heads, n_m_blocks, n_tiles,
                             PERSISTENT)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.static_assert(CONSUMERS == 3, "two or three consumer warpgroups")
            gl.warp_specialize([
                (_consumer, (0, q_desc, o_desc, q_tiles, o_tiles, q_bars, k_bufs, v_bufs, k_ready, k_empty,
                             v_ready, v_empty, turn_bars, LSE, batch, head, num_heads, m0, seq_q, seq_k,
                             n_blocks, qk_scale, bias_row, pure, key_lo, first_block, n_m_blocks,
                             n_tiles, CAUSAL, PINGPONG, HAS_MASK, RANGE_LOOP, RAW_SCORES, PERSISTENT)),
                (_consumer, (1, q_desc, o_desc, q_tiles, o_tiles, q_bars, k_bufs, v_bufs, k_ready, k_empty,
                             v_ready, v_empty, turn_bars, LSE, batch, head, num_heads, m0, seq_q, seq_k,
                             n_blocks, qk_scale, bias_row, pure, key_lo, first_block, n_m_blocks,
                             n_tiles, CAUSAL, PINGPONG, HAS_MASK, RANGE_LOOP, RAW_SCORES, PERSISTENT)),
                (_consumer, (2, q_desc, o_desc, q_tiles, o_tiles, q_bars, k_bufs, v_bufs, k_ready, k_empty,
                             v_ready, v_empty, turn_bars, LSE, batch, head, num_heads, m0, seq_q, seq_k,
                             n_blocks, qk_scale, bias_row, pure, key_lo, first_block, n_m_blocks,
                             n_tiles, CAUSAL, PINGPONG, HAS_MASK, RANGE_LOOP, RAW_SCORES, PERSISTENT)),
                (_producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, batch,
                             head // group, first_key, n_blocks, group, num_heads, n_m_blocks, n_tiles,
                             PERSISTENT)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------------------------------------------- host


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


# The causal forward's groups of rows (_heaviest_first) hold about this many waves of CTAs (one CTA an SM).
# Each CTA alone (bench/probes/attention_causal_order_probe.py, bench/logs/attention_causal_order_probe_s28_
# h200.log), against the plain order: groups of 2-8 waves gained 1.02-1.08x at the bench's causal rows
# (4 waves: 1.03x at 8,16,2048,128, 1.07x at 2,16,8192,64), 1 wave or less gained less, 1.19x at 3,5,4500,128.
HEAVIEST_FIRST_WAVES = 4


def heaviest_first_rows(blocks: int, rows: int, causal: bool, device: torch.device, waves: int) -> int:
    """rows_per_group of _heaviest_first for a (blocks, rows) grid: 1, the plain order, without causal
    masking (a row's blocks are the same work); else the power of two at or below the rows that hold
    `waves` waves of CTAs (at most all rows). Rounded down: a larger group is more for L2 to hold (groups
    of 5 rows measured 0.99x at head_dim 256, where 4 and 8 gained 1.04x)."""
    if not causal:
        return 1
    group = max(1, min(rows, cdiv(waves * sm_count(device), blocks)))
    return 1 << (group.bit_length() - 1)


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA's layout rules: a contiguous last dim, every other stride and the start 16-byte aligned. A
    broadcast (stride-0) dim, which expand() makes, is left to the Triton kernels as well."""
    align = 16 // t.element_size()
    strides_ok = all(s % align == 0 and s > 0 for s in t.stride()[:-1])
    return t.stride(-1) == 1 and strides_ok and t.storage_offset() % align == 0


def padding_mask_ok(attn_mask, window_left, window_right) -> bool:
    """Whether both Gluon kernels take this attn_mask: none, or a padding mask, one row of keys per (batch,
    head) broadcast over the queries (attention_fwd.mask_is_query_broadcast), bool or additive, with no
    causal masking or window (a query row before the mask's first live key would see none of the keys;
    the Triton kernels handle those combinations)."""
    if attn_mask is None:
        return True
    if window_left != -1 or window_right != -1 or attn_mask.dim() != 4:
        return False
    return mask_is_query_broadcast(attn_mask) and attn_mask.dtype in _MASK_DTYPES


def plain_attention_case(q, k, v, attn_mask, dropout_p, window_left, window_right, bottom_right,
                         grid_rows) -> bool:
    """What both Gluon kernels (this forward, kernels/attention_bwd_hopper.py's backward) need of a call,
    short of the device and strides (sm90_tma_inputs): no mask but a padding one (padding_mask_ok), no
    dropout or window; causal only top-left (or bottom-right with Sq == Sk, the same thing); fp16 / bf16
    throughout; v's head_dim q's; at least MIN_SCORES scores; grid_rows (the launch grid's second axis)
    within CUDA's limit. Cheap checks only, from dtypes and shapes, so that a traced graph and its run
    agree: eager calls of every attention pay it."""
    if dropout_p != 0.0 or window_left != -1 or window_right not in (-1, 0):
        return False
    if not padding_mask_ok(attn_mask, window_left, window_right):
        return False
    if not GLUON_AVAILABLE or q.device.type != "cuda":
        return False
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    if B * H * Sq * Sk < MIN_SCORES or grid_rows > MAX_GRID_Y or v.shape[-1] != D:
        return False
    if window_right == 0 and bottom_right and Sq != Sk:
        return False
    return q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype


def sm90_tma_inputs(q, k, v) -> bool:
    """q's device is an sm_90 GPU and q, k, v are tensors TMA can describe (the checks that cost most)."""
    return _is_sm90(device_index(q.device)) and all(_tma_ok(t) for t in (q, k, v))


def hopper_forward_supported(q, k, v, attn_mask, dropout_p, window_left, window_right, bottom_right) -> bool:
    """Whether the Gluon forward computes this call (else the Triton forward does)."""
    B, H, Sq, D = q.shape
    grid_rows = B * H
    if not plain_attention_case(q, k, v, attn_mask, dropout_p, window_left, window_right, bottom_right,
                                grid_rows):
        return False
    causal = window_right == 0
    # compared, not hashed: under dynamic shapes D may be a SymInt, which a dict lookup cannot hash
    if D == 64 and Sq < (MIN_SEQ_Q_CAUSAL_64 if causal else MIN_SEQ_Q_THREE_CONSUMERS):
        return False
    if not any(D == d and causal == c for d, c in CONFIGS):
        return False
    return sm90_tma_inputs(q, k, v)


def compile_sm90(head_dim: int, dtype: str, causal: bool, config, mask: bool = False):
    """The kernel compiled ahead of time for sm_90, no GPU needed (what the CPU tests check of it; Gluon has
    no interpreter). dtype: "bf16" or "fp16"; config as attention_forward_hopper_launch's; mask: the
    padding-mask variant."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    block_n, stages, pingpong, consumers, raw_scores, persistent = _full_config(config)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    signature = {}
    for name, rows in (("q_desc", BLOCK_M), ("k_desc", block_n), ("v_desc", block_n), ("o_desc", BLOCK_M)):
        block, layout = _tile(rows, head_dim, torch_dtype)
        signature[name] = f"tensordesc<{dtype}{block},{layout!r}>"
    signature.update(LSE="*fp32", BIAS="*fp32", KEY_RANGE="*i32", PURE="*i32", seq_q="i32", seq_k="i32",
                     num_heads="i32", group="i32", qk_scale="fp32", bias_len="i32", mask_row_b="i32",
                     mask_row_h="i32", rows_per_group="i32", num_bh="i32")
    maxnreg, consumer_regs = _REGS[consumers]
    constexprs = dict(CONSUMERS=consumers, STAGES=stages, CAUSAL=causal, PINGPONG=pingpong,
                      RAW_SCORES=raw_scores, PERSISTENT=persistent, HAS_MASK=mask,
                      RANGE_LOOP=mask and head_dim in RANGE_LOOP_HEAD_DIMS,
                      PRODUCER_REGS=_PRODUCER_REGS, CONSUMER_REGS=consumer_regs)
    signature.update({name: "constexpr" for name in constexprs})
    src = GluonASTSource(fn=_attention_fwd_hopper_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": maxnreg})


def routed_config(head_dim: int, seq_q: int, causal: bool, has_mask: bool) -> tuple:
    """The configuration a routed call runs: CONFIGS', persistent (PERSISTENT_MAX_SEQ_Q_128) where that
    measured faster, and a padding mask's without RAW_SCORES (CONFIGS' comment)."""
    block_n, stages, pingpong, consumers, raw_scores, _ = _full_config(CONFIGS[(head_dim, causal)])
    persistent = head_dim == 128 and not (causal or has_mask) and seq_q <= PERSISTENT_MAX_SEQ_Q_128
    # with a mask RAW_SCORES reaches only the pure rows' loop (KEYS_RANGE; the bias loop keeps the scaled
    # scores), measured there at head_dim 64: 1.04-1.06x (bench/logs/attention_padding_range_peel_s33_h200
    # .log)
    raw_scores = raw_scores and (not has_mask or head_dim in RAW_RANGE_HEAD_DIMS)
    return (block_n, stages, pingpong, consumers, raw_scores, persistent)


def _full_config(config) -> tuple:
    """(BLOCK_N, STAGES, PINGPONG, CONSUMERS, RAW_SCORES, PERSISTENT); shorter tuples (the probes' older
    configurations) run without the options they lack."""
    return (*config, False, False)[:6]


@functools.cache
def _tile(rows: int, head_dim: int, dtype: torch.dtype):
    """The [1, 1, rows, head_dim] tile of a descriptor and its shared-memory layout (cached: every eager call
    builds four descriptors)."""
    block = [1, 1, rows, head_dim]
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return block, gl.NVMMASharedLayout.get_default_for(block, element)


def _descriptor(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """A (B, H, S, D) descriptor of t's own strides, loading [1, 1, block_rows, D] tiles."""
    block, layout = _tile(block_rows, t.shape[-1], t.dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), layout)


def padding_mask_args(attn_mask, seq_k, dummy):
    """(bias, key ranges, pure flags, (bias_len, mask_row_b, mask_row_h), has mask): a padding mask as both
    Gluon kernels take it, prepared by one small Triton launch (attention_fwd.mask_key_ranges): each mask
    row's live key range, its bias, fp32 in base 2, padded with -inf to whole 128-key blocks (the largest
    block of either kernel), and whether it is plain padding (the range is the whole mask); a (batch, head)
    pair reads row batch * mask_row_b + head * mask_row_h (0 on a dim the mask broadcasts). Without a mask,
    dummy in place of the tensors."""
    if attn_mask is None:
        return dummy, dummy, dummy, (0, 0, 0), False
    mask_strides = tuple(0 if attn_mask.shape[d] == 1 else attn_mask.stride(d) for d in range(4))
    bias_len = cdiv(seq_k, _BIAS_BLOCK) * _BIAS_BLOCK
    ranges, (range_b, range_h), bias, pure = mask_key_ranges(attn_mask, mask_strides, seq_k,
                                                             attn_mask.dtype == torch.bool, fast_kernel,
                                                             bias_len)
    return bias, ranges, pure, (bias_len, range_b // 2, range_h // 2), True


def attention_forward_hopper_launch(q, k, v, scale, causal, out, lse, config=None, attn_mask=None,
                                    rows_per_group=None):
    """Fill out (B, H, Sq, D) and lse (B, H, Sq, contiguous) with the Gluon forward; the caller checked
    hopper_forward_supported(...), that out is TMA-compatible and that scale > 0. config = (BLOCK_N, STAGES,
    PINGPONG, CONSUMERS[, RAW_SCORES[, PERSISTENT]]); attn_mask: None or a padding mask (padding_mask_ok);
    rows_per_group: the launch order's (_heaviest_first; heaviest_first_rows's when None)."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if not scale > 0:  # every configuration: the routing does not ask which one takes the raw scores
        raise ValueError(f"attention_forward_hopper_launch: scale must be > 0 (RAW_SCORES scales each row's "
                         f"max of the raw scores), got {scale}")
    if B * H * Sq == 0:
        return
    if not _tma_ok(out) or not lse.is_contiguous():
        raise ValueError("attention_forward_hopper_launch: out needs TMA-compatible strides and lse to be "
                         "contiguous (B, H, Sq)")
    config = _full_config(config or routed_config(D, Sq, causal, attn_mask is not None))
    block_n, stages, pingpong, consumers, raw_scores, persistent = config
    maxnreg, consumer_regs = _REGS[consumers]
    bias, key_ranges, pure, mask_ints, has_mask = padding_mask_args(attn_mask, Sk, lse)
    grid = (cdiv(Sq, consumers * BLOCK_M), B * H)
    if rows_per_group is None:
        rows_per_group = heaviest_first_rows(*grid, causal, q.device, HEAVIEST_FIRST_WAVES)
    persistent = persistent and not (causal or has_mask)
    if persistent:  # a CTA an SM, each taking every sm_count-th tile (_tile_of)
        grid = (min(grid[0] * grid[1], sm_count(q.device)), 1)
    fast_kernel(_attention_fwd_hopper_kernel)[grid](
        _descriptor(q, BLOCK_M), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(out, BLOCK_M),
        lse, bias, key_ranges, pure, Sq, Sk, H, H // Hkv, scale * LOG2E, *mask_ints, rows_per_group, B * H,
        CONSUMERS=consumers, RAW_SCORES=raw_scores, PERSISTENT=persistent,
        STAGES=stages, CAUSAL=causal, PINGPONG=pingpong, HAS_MASK=has_mask,
        RANGE_LOOP=has_mask and D in RANGE_LOOP_HEAD_DIMS, PRODUCER_REGS=_PRODUCER_REGS,
        CONSUMER_REGS=consumer_regs, num_warps=4, maxnreg=maxnreg,
    )
