"""Exact attention (FlashAttention-2 algorithm): `flash::attention_forward` / `flash::attention_backward`.

Trade-off: by default the backward uses no atomics. dK/dV are produced by one kernel that walks the query
blocks (and, for GQA, every query head of the group) of one key block, dQ by a second kernel that walks the
key blocks of one query block. That recomputes QK^T and dO V^T once more (7 matmuls instead of FA2's 5) but
is deterministic, needs no fp32 dQ scratch buffer and no zeroing pass, and GQA costs no extra memory.
The one exception is where FA2's way measured faster on the H200: with dropout at head_dim <= 64 and no
mask, unless `torch.are_deterministic_algorithms_enabled()`, the dK/dV kernel also accumulates dQ with fp32
atomics (kernels/attention_bwd.py: use_atomic_dq). With deterministic algorithms on, and for varlen,
every path is deterministic.

On Hopper the plain cases (no mask or only a padding mask, no dropout or window; 2**28 scores or more) run
the Gluon kernels in FlashAttention-3's structure instead: the forward (kernels/attention_fwd_hopper.py,
head_dim 64 / 128 / 256) and, unless deterministic algorithms are on, the backward (kernels/
attention_bwd_hopper.py, head_dim 64 / 128, and kernels/attention_bwd_hopper_256.py without a mask), which
adds dQ into an fp32 buffer by TMA reduce-add. In
traced graphs they are the opaque ops flash::attention_forward_hopper / flash::attention_backward_hopper
(wrap_triton cannot trace Gluon).

Conventions shared by the reference and the kernels:
- key j is visible to query i when `i + off - left <= j <= i + off + right` (a negative bound is
  unlimited), off = Sk - Sq for bottom-right alignment and 0 for top-left (SDPA's causal); causal is
  right = 0.
- attn_mask is a 4-d view whose dims are 1 or full (stride 0 broadcast): bool (True = keep) or additive.
- a fully masked row yields out = 0 and logsumexp = +inf, so that exp(s - lse) = 0 in the backward.
- a row that a finite additive mask as large as finfo.min blocks entirely is not fully masked: the reference
  gives eager's softmax there (the average of v); the kernels scale the mask by log2(e), which overflows
  such a fill to -inf, and give 0 (bf16 / fp16 on CUDA; a documented difference from eager).
- dropout: one Philox-4x32-7 call (Triton's tl.random.philox, 7 rounds) per 8 keys of a query row. Key j
  (inside the sequence) is split as j = 32a + 8b + 2c + e (a >= 0, b, c in 0..3, e in 0..1); it belongs to
  call g = 4a + c with counter (i * 4 * ceil(Sk / 32) + g, b * H + h, 0, 0) and takes word b of the 4
  words, its low half for e = 0 and its high half for e = 1. The element is kept when that half is
  >= t = round(p * 65536) clamped to [0, 65535], and kept values are scaled by 65536 / (65536 - t), the
  inverse of the exact keep probability, so the output stays unbiased for the quantised p (|p - t / 65536|
  <= 2**-17).
  Why this order: in the score tile of Hopper's tensor-core instructions a thread holds, per row, the
  key pairs 2c + {0, 1} of every 8-key column block, so the 8 keys of one call sit in one thread and the
  kernels use the words where Philox computed them (consecutive keys per call needed a shared-memory
  layout conversion per tile, which cost the forward ~2.5x its no-dropout time on an H200). One call per
  key made Philox's integer work the bottleneck (~7x). Reproduced bit-exactly here in int64 arithmetic,
  so the reference and the kernels drop the same elements; varlen uses positions and lengths inside each
  sequence.
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch.library import triton_op

from flash_backend import config
from flash_backend._traced_launch import traced_launch
from flash_backend.ops._eager import direct_call_ok, needs_autograd, plain_launch
from flash_backend.ops._forward_ad import refuse_forward_ad
from flash_backend.ops._outputs import as_output
from flash_backend.ops._philox import (  # noqa: F401  (re-exported: the tests and bench read them here)
    DROPOUT_PHILOX_ROUNDS,
    HALF,
    dropout_scale,
    dropout_threshold,
    philox_4x32,
)

__all__ = [
    "attention_reference",
    "attention_backward_reference",
    "attention_varlen_reference",
    "flash_attention",
    "flash_attention_varlen",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


# --------------------------------------------------------------------------------------------------------
# Dropout RNG: Triton's philox in int64 torch arithmetic (ops/_philox.py, shared with the norm op); the
# counter layout is in the module docstring (Conventions).
# --------------------------------------------------------------------------------------------------------

DROPOUT_KEYS_PER_CALL = 8  # one Philox call = 4 words = 8 16-bit halves = 8 keys (see Conventions)
DROPOUT_KEY_SPAN = 32  # ...spread over 32 consecutive keys: key tiles must start and end on this span


def dropout_keep(seed, dropout_p, i, j, seqlen_k, bh) -> torch.Tensor:
    """Keep-mask of query i and key j (positions inside the sequence, int64 tensors that broadcast) of a
    sequence of seqlen_k keys (an int or a broadcastable tensor), (batch, head) id bh: the kernels' draw.

    Each element runs its own Philox call here (simple, and as cheap as the one-per-key scheme was); the
    kernels run one per 8 keys and split its words into halves, which gives the same bits.
    """
    calls_per_row = 4 * ((seqlen_k + DROPOUT_KEY_SPAN - 1) // DROPOUT_KEY_SPAN)
    call = 4 * (j // DROPOUT_KEY_SPAN) + (j // 2) % 4
    r0, r1, r2, r3 = philox_4x32(seed, i * calls_per_row + call, bh, DROPOUT_PHILOX_ROUNDS)
    word_idx = (j // 8) % 4
    word = torch.where(word_idx == 0, r0, torch.where(word_idx == 1, r1, torch.where(word_idx == 2, r2, r3)))
    half = (word >> (16 * (j % 2))) & (HALF - 1)  # e = 0: low half, e = 1: high half
    return half >= dropout_threshold(dropout_p)


def dropout_keep_mask(seed, dropout_p, B, H, Sq, Sk, device) -> torch.Tensor:
    i = torch.arange(Sq, device=device, dtype=torch.int64).view(Sq, 1)
    j = torch.arange(Sk, device=device, dtype=torch.int64).view(1, Sk)
    bh = torch.arange(B * H, device=device, dtype=torch.int64).view(B, H, 1, 1)
    return dropout_keep(seed, dropout_p, i, j, Sk, bh)


# --------------------------------------------------------------------------------------------------------
# Reference (the CPU implementation): plain PyTorch, fp32 accumulation.
# --------------------------------------------------------------------------------------------------------


def _visible(Sq, Sk, window_left, window_right, bottom_right, device) -> torch.Tensor | None:
    if window_left < 0 and window_right < 0:
        return None
    off = Sk - Sq if bottom_right else 0
    i = torch.arange(Sq, device=device).view(Sq, 1) + off
    j = torch.arange(Sk, device=device).view(1, Sk)
    keep = torch.ones(Sq, Sk, dtype=torch.bool, device=device)
    if window_left >= 0:
        keep &= j >= i - window_left
    if window_right >= 0:
        keep &= j <= i + window_right
    return keep


def _acc_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def _scores(q, k, attn_mask, scale, window_left, window_right, bottom_right, upcast):
    dt = _acc_dtype(q) if upcast else q.dtype
    group = q.shape[1] // k.shape[1]
    kf = k.to(dt).repeat_interleave(group, dim=1)
    s = torch.matmul(q.to(dt), kf.transpose(-1, -2)) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.to(s.dtype)
    vis = _visible(q.shape[2], k.shape[2], window_left, window_right, bottom_right, q.device)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    return s


def _softmax_with_lse(s):
    """Probabilities softmax(s) over the last dim (0 on a row whose scores are all -inf) and the row's
    logsumexp (+inf there), in s's dtype.

    Divided by the row sum, not exp(s - lse): a row that a finite mask as large as finfo.min blocks entirely
    (transformers' padded rows) has scores that are all about -3.4e38, whose lse rounds to its max (log(n) is
    absorbed), so exp(s - lse) gave every key probability 1 and the output sum(v) where eager's softmax
    gives the average of v."""
    if s.shape[-1] == 0:
        # No keys at all (Sk = 0): every row is fully masked (out 0, lse +inf). amax has no identity and
        # raised "Expected reduction dim -1 to have non-zero size" (eager SDPA gives zeros here).
        return torch.zeros_like(s), torch.full(s.shape[:-1], float("inf"), dtype=s.dtype, device=s.device)
    peak = s.amax(-1, keepdim=True)
    dead = torch.isneginf(peak)
    e = torch.exp(s - torch.where(dead, torch.zeros_like(peak), peak))
    total = e.sum(-1, keepdim=True)
    p = torch.where(dead, torch.zeros_like(e), e / torch.where(dead, torch.ones_like(total), total))
    lse = torch.where(dead, torch.full_like(peak, float("inf")), peak + torch.log(total)).squeeze(-1)
    return p, lse


def attention_reference(q, k, v, attn_mask=None, seed=None, dropout_p=0.0, scale=None, window_left=-1,
                        window_right=-1, bottom_right=False, upcast=True):
    """out (q.dtype) and logsumexp (fp32, +inf on fully masked rows) on (B, H, S, D) tensors.

    upcast=False computes in the input dtype: the "plain PyTorch low precision" error yardstick.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _scores(q, k, attn_mask, scale, window_left, window_right, bottom_right, upcast)
    s_acc = s.to(_acc_dtype(s))
    p, lse = _softmax_with_lse(s_acc)
    if s_acc.dtype != s.dtype:  # upcast=False: the probabilities in the input dtype, the lse in fp32
        p, _ = _softmax_with_lse(s)
    if dropout_p > 0.0:
        B, H, Sq, Sk = s.shape
        keep = dropout_keep_mask(seed, dropout_p, B, H, Sq, Sk, q.device)
        p = p * keep * dropout_scale(dropout_p)
    group = q.shape[1] // v.shape[1]
    vf = v.to(p.dtype).repeat_interleave(group, dim=1)
    out = torch.matmul(p, vf)
    return out.to(q.dtype), lse.to(_acc_dtype(q))


def _sum_to(t: torch.Tensor, shape) -> torch.Tensor:
    dims = [d for d in range(t.dim()) if shape[d] == 1 and t.shape[d] != 1]
    return t.sum(dim=dims, keepdim=True) if dims else t


def attention_backward_reference(dout, q, k, v, out, lse, attn_mask=None, seed=None, dropout_p=0.0,
                                 scale=None, window_left=-1, window_right=-1, bottom_right=False,
                                 compute_dbias=False):
    """dq, dk, dv (input dtypes) and dbias (attn_mask's shape and dtype, or None), fp32 math."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    acc = _acc_dtype(q)
    s = _scores(q, k, attn_mask, scale, window_left, window_right, bottom_right, True)
    p, _ = _softmax_with_lse(s)  # recomputed, not exp(s - lse): _softmax_with_lse says why
    do = dout.to(acc)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    if dropout_p > 0.0:
        keep = dropout_keep_mask(seed, dropout_p, B, Hq, Sq, Sk, q.device).to(acc) * dropout_scale(dropout_p)
        pd = p * keep
        dp = dp * keep
    else:
        pd = p
    delta = (do * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, k.to(acc).repeat_interleave(group, dim=1)) * scale
    # head dims spelled out, not -1: with B, H or Sk = 0 the tensors are empty and view(..., -1) raised
    dk = (torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale).view(B, Hkv, group, Sk, q.shape[-1]).sum(2)
    dv = torch.matmul(pd.transpose(-1, -2), do).view(B, Hkv, group, Sk, v.shape[-1]).sum(2)
    dbias = None
    if compute_dbias:
        dbias = _sum_to(ds, attn_mask.shape).to(attn_mask.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias


def _segments(cu_seqlens, total, device):
    idx = torch.arange(total, device=device)
    seg = torch.searchsorted(cu_seqlens.to(torch.int64), idx, right=True) - 1
    pos = idx - cu_seqlens.to(torch.int64)[seg]
    return seg, pos


def _varlen_scores(q, k, cu_q, cu_k, scale, window_left, window_right, bottom_right):
    # Packed (T, H, D) -> one (H, Tq, Tk) problem with a block-diagonal mask: vectorized, traceable.
    Tq, Tk = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    seg_q, pos_q = _segments(cu_q, Tq, q.device)
    seg_k, pos_k = _segments(cu_k, Tk, q.device)
    acc = _acc_dtype(q)  # fp64 stays fp64 (it was fp32 here: fp64 inputs got fp32-accurate results)
    qf = q.to(acc).transpose(0, 1)
    kf = k.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    keep = seg_q.view(-1, 1) == seg_k.view(1, -1)
    len_q = (cu_q[1:] - cu_q[:-1]).to(torch.int64)[seg_q]
    len_k = (cu_k[1:] - cu_k[:-1]).to(torch.int64)[seg_k]
    i = pos_q.view(-1, 1)
    if bottom_right:
        i = i + (len_k.view(1, -1) - len_q.view(-1, 1))
    j = pos_k.view(1, -1)
    if window_left >= 0:
        keep &= j >= i - window_left
    if window_right >= 0:
        keep &= j <= i + window_right
    return s.masked_fill(~keep, float("-inf")), seg_q, pos_q, seg_k, pos_k


def _varlen_keep(seed, dropout_p, cu_k, seg_q, pos_q, seg_k, pos_k, H, device):
    # (H, Tq, Tk); pairs from different sequences get some value, masked out by the scores anyway
    len_k = (cu_k[1:] - cu_k[:-1]).to(torch.int64)[seg_q]
    bh = (seg_q.view(1, -1, 1) * H + torch.arange(H, device=device).view(-1, 1, 1))
    return dropout_keep(seed, dropout_p, pos_q.view(1, -1, 1), pos_k.view(1, 1, -1), len_k.view(1, -1, 1), bh)


def attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, seed=None, dropout_p=0.0, scale=None,
                               window_left=-1, window_right=-1, bottom_right=False):
    """out (Tq, H, D) and logsumexp (H, Tq) on packed sequences; fp32 math (fp64 for fp64 inputs)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s, seg_q, pos_q, seg_k, pos_k = _varlen_scores(q, k, cu_seqlens_q, cu_seqlens_k, scale, window_left,
                                                   window_right, bottom_right)
    p, lse = _softmax_with_lse(s)  # 0 and +inf on a row with no visible key
    if dropout_p > 0.0:
        keep = _varlen_keep(seed, dropout_p, cu_seqlens_k, seg_q, pos_q, seg_k, pos_k, q.shape[1], q.device)
        p = p * keep * dropout_scale(dropout_p)
    group = q.shape[1] // v.shape[1]
    vf = v.to(p.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    out = torch.matmul(p, vf).transpose(0, 1)
    return out.to(q.dtype), lse


def attention_varlen_backward_reference(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed=None,
                                        dropout_p=0.0, scale=None, window_left=-1, window_right=-1,
                                        bottom_right=False):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    H, Hkv = q.shape[1], k.shape[1]
    group = H // Hkv
    s, seg_q, pos_q, seg_k, pos_k = _varlen_scores(q, k, cu_seqlens_q, cu_seqlens_k, scale, window_left,
                                                   window_right, bottom_right)
    # recomputed, not exp(s - lse): the saved lse is fp32, which cost fp64 inputs their precision
    p, _ = _softmax_with_lse(s)
    acc = p.dtype
    do = dout.to(acc).transpose(0, 1)
    vf = v.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    pd = p
    if dropout_p > 0.0:
        keep = _varlen_keep(seed, dropout_p, cu_seqlens_k, seg_q, pos_q, seg_k, pos_k, H, q.device)
        keep = keep * dropout_scale(dropout_p)
        pd, dp = p * keep, dp * keep
    delta = (do * out.to(acc).transpose(0, 1)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    kf = k.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)
    dq = (torch.matmul(ds, kf) * scale).transpose(0, 1)
    Tk = k.shape[0]
    dk = (torch.matmul(ds.transpose(-1, -2), q.to(acc).transpose(0, 1)) * scale)
    # head dims spelled out, not -1: with no keys (Tk = 0) the tensors are empty and view(..., -1) raised
    dk = dk.view(Hkv, group, Tk, q.shape[-1]).sum(1).transpose(0, 1)
    dv = torch.matmul(pd.transpose(-1, -2), do).view(Hkv, group, Tk, v.shape[-1]).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------------------------------------
# Allocation (shared by the real implementations and the fakes, so that both agree on strides).
# --------------------------------------------------------------------------------------------------------


def _empty_like_layout(x: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    """Empty tensor of `shape` whose memory order follows x's strides (SDPA keeps a (B,S,H,D) layout)."""
    if x.is_contiguous():  # the common case, without the sort (eager calls pay this function's host time)
        return x.new_empty(shape, dtype=dtype or x.dtype)
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
    if order[-1] != x.dim() - 1:
        order = list(range(x.dim()))
    buf = x.new_empty([shape[d] for d in order], dtype=dtype or x.dtype)
    inverse = [order.index(d) for d in range(x.dim())]
    return buf.permute(inverse)


def _alloc_forward(q, v):
    B, H, Sq, _ = q.shape
    out = _empty_like_layout(q, (B, H, Sq, v.shape[-1]))
    lse = q.new_empty((B, H, Sq), dtype=torch.float32)
    return out, lse


def _alloc_dbias(q, attn_mask, compute_dbias, launch=traced_launch):
    if compute_dbias:
        return attn_mask.new_empty(attn_mask.shape)
    if launch is plain_launch:  # a direct call's _backward_with drops it: no allocation (host time)
        return None
    return q.new_empty((0,))


def _kernels_enabled(t: torch.Tensor) -> bool:
    if t.device.type == "cuda":
        return os.environ.get("FLASH_ATTENTION_REFERENCE", "0") != "1"
    return False


def _kernel_supports(q, k, v, attn_mask) -> bool:
    return (q.dtype in _KERNEL_DTYPES and q.shape[-1] == v.shape[-1]
            and (attn_mask is None or attn_mask.dtype in (torch.bool, torch.float16, torch.bfloat16,
                                                          torch.float32)))


# --------------------------------------------------------------------------------------------------------
# The registered ops.
# --------------------------------------------------------------------------------------------------------


def _hopper_forward(q, k, v, scale, causal, attn_mask=None):
    """out, lse from the Gluon forward for Hopper (kernels/attention_fwd_hopper.py); attn_mask None or a
    padding mask (attention_fwd_hopper.padding_mask_ok)."""
    from flash_backend.kernels.attention_fwd_hopper import attention_forward_hopper_launch

    out, lse = _alloc_forward(q, v)
    attention_forward_hopper_launch(q, k, v, scale, causal, out, lse, attn_mask=attn_mask)
    return out, lse


# The Gluon kernel is not a Triton kernel that wrap_triton can trace, so inside the traced body of
# flash::attention_forward it is this opaque op: Inductor calls it as it stands (CUDA only; the body routes
# nothing else to it).
@torch.library.custom_op("flash::attention_forward_hopper", mutates_args=(), device_types="cuda")
def attention_forward_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                             attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _hopper_forward(q, k, v, scale, causal, attn_mask)


@attention_forward_hopper.register_fake
def _(q, k, v, scale, causal, attn_mask=None):
    return _alloc_forward(q, v)


def _attention_forward_impl(q, k, v, attn_mask, seed, dropout_p, scale, window_left, window_right,
                           bottom_right, launch=traced_launch):
    """The body of flash::attention_forward; `launch` is plain_launch on the eager fast path."""
    kernels = _kernels_enabled(q)
    if kernels and config.hopper_attention_forward:
        from flash_backend.kernels.attention_fwd_hopper import hopper_forward_supported

        # scale > 0: the Gluon softmax scales each row's max of the raw scores (attention_fwd_hopper._row_max)
        if scale > 0 and hopper_forward_supported(q, k, v, attn_mask, dropout_p, window_left, window_right,
                                                  bottom_right):
            causal = window_right == 0
            if launch is plain_launch:  # the eager fast path: no dispatcher
                return _hopper_forward(q, k, v, scale, causal, attn_mask)
            return torch.ops.flash.attention_forward_hopper(q, k, v, scale, causal, attn_mask)
    out, lse = _alloc_forward(q, v)
    if kernels and _kernel_supports(q, k, v, attn_mask):
        from flash_backend.kernels.attention_fwd import attention_forward_launch

        attention_forward_launch(q, k, v, attn_mask, seed, dropout_p, scale, window_left, window_right,
                                 bottom_right, out, lse, launch=launch)
        return out, lse
    ref_out, ref_lse = attention_reference(q, k, v, attn_mask, seed, dropout_p, scale, window_left,
                                           window_right, bottom_right)
    # results returned, not copied into the buffers: ops/_outputs.py says why
    return as_output(ref_out, out), as_output(ref_lse, lse)


@triton_op("flash::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                      seed: torch.Tensor | None, dropout_p: float, scale: float, window_left: int,
                      window_right: int, bottom_right: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _attention_forward_impl(q, k, v, attn_mask, seed, dropout_p, scale, window_left, window_right,
                                   bottom_right)


@attention_forward.register_fake
def _(q, k, v, attn_mask, seed, dropout_p, scale, window_left, window_right, bottom_right):
    return _alloc_forward(q, v)


def _hopper_backward(dout, q, k, v, out, lse, scale, causal, attn_mask=None):
    """dq, dk, dv from the Gluon backward for Hopper (kernels/attention_bwd_hopper.py); attn_mask None or a
    padding mask that needs no gradient."""
    from flash_backend.kernels.attention_bwd_hopper import attention_backward_hopper_launch

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    attention_backward_hopper_launch(dout, q, k, v, out, lse, scale, causal, dq, dk, dv, attn_mask=attn_mask)
    return dq, dk, dv


# Opaque in traced graphs for the same reason as flash::attention_forward_hopper.
@torch.library.custom_op("flash::attention_backward_hopper", mutates_args=(), device_types="cuda")
def attention_backward_hopper(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
                              attn_mask: torch.Tensor | None = None,
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _hopper_backward(dout, q, k, v, out, lse, scale, causal, attn_mask)


@attention_backward_hopper.register_fake
def _(dout, q, k, v, out, lse, scale, causal, attn_mask=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_backward_impl(dout, q, k, v, out, lse, attn_mask, seed, dropout_p, scale, window_left,
                            window_right, bottom_right, compute_dbias, deterministic, launch=traced_launch):
    """The body of flash::attention_backward; `launch` is plain_launch on the eager fast path."""
    kernels = _kernels_enabled(q)
    if kernels and config.hopper_attention_backward:
        from flash_backend.kernels.attention_bwd_hopper import hopper_backward_supported

        # scale > 0: the Gluon backward's products start from -logsumexp / scale
        # (attention_bwd_hopper._consumer)
        if scale > 0 and hopper_backward_supported(q, k, v, attn_mask, dropout_p, window_left, window_right,
                                                   bottom_right, deterministic, compute_dbias):
            causal = window_right == 0
            if launch is plain_launch:  # the eager fast path: no dispatcher
                dq, dk, dv = _hopper_backward(dout, q, k, v, out, lse, scale, causal, attn_mask)
            else:
                dq, dk, dv = torch.ops.flash.attention_backward_hopper(dout, q, k, v, out, lse, scale, causal,
                                                                       attn_mask)
            return dq, dk, dv, _alloc_dbias(q, attn_mask, compute_dbias, launch)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dbias = _alloc_dbias(q, attn_mask, compute_dbias, launch)
    if kernels and _kernel_supports(q, k, v, attn_mask):
        from flash_backend.kernels.attention_bwd import attention_backward_launch, use_atomic_dq
        from flash_backend.kernels.attention_fwd import mask_is_query_broadcast

        mask_tiles = attn_mask is not None and (compute_dbias or not mask_is_query_broadcast(attn_mask))
        atomic_dq = use_atomic_dq(q.shape[-1], dropout_p, mask_tiles, deterministic)
        attention_backward_launch(dout, q, k, v, out, lse, attn_mask, seed, dropout_p, scale, window_left,
                                  window_right, bottom_right, dq, dk, dv, dbias if compute_dbias else None,
                                  atomic_dq=atomic_dq, launch=launch)
        return dq, dk, dv, dbias
    rdq, rdk, rdv, rdb = attention_backward_reference(dout, q, k, v, out, lse, attn_mask, seed, dropout_p,
                                                      scale, window_left, window_right, bottom_right,
                                                      compute_dbias)
    # results returned, not copied into the buffers: ops/_outputs.py says why
    if compute_dbias:
        dbias = as_output(rdb, dbias)
    return as_output(rdq, dq), as_output(rdk, dk), as_output(rdv, dv), dbias


@triton_op("flash::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, attn_mask: torch.Tensor | None,
                       seed: torch.Tensor | None, dropout_p: float, scale: float, window_left: int,
                       window_right: int, bottom_right: bool, compute_dbias: bool,
                       deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv like the inputs; dbias in attn_mask's shape when compute_dbias, else an empty tensor.

    `deterministic` (the autograd passes `torch.are_deterministic_algorithms_enabled()`) rules out the
    atomic dQ accumulation, the only non-deterministic path (module docstring).
    """
    return _attention_backward_impl(dout, q, k, v, out, lse, attn_mask, seed, dropout_p, scale, window_left,
                                    window_right, bottom_right, compute_dbias, deterministic)


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, attn_mask, seed, dropout_p, scale, window_left, window_right, bottom_right,
      compute_dbias, deterministic):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            _alloc_dbias(q, attn_mask, compute_dbias))


def _forward_setup_context(ctx, inputs, output):
    q, k, v, attn_mask, seed, dropout_p, scale, window_left, window_right, bottom_right = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, attn_mask, seed, out, lse)
    ctx.params = (dropout_p, scale, window_left, window_right, bottom_right)
    ctx.mark_non_differentiable(lse)
    # No zero-filled grad for lse (non-differentiable): materialising it cost a fill kernel and ~0.1 ms of
    # host time per eager backward on the H200 host (scratch probe, session 3).
    ctx.set_materialize_grads(False)


def _backward_with(ctx, dout, attention_backward_fn):
    if dout is None:  # out does not reach the loss: every input grad is zero
        return (None,) * 10
    q, k, v, attn_mask, seed, out, lse = ctx.saved_tensors
    compute_dbias = bool(attn_mask is not None and ctx.needs_input_grad[3])
    dq, dk, dv, dbias = attention_backward_fn(
        dout, q, k, v, out, lse, attn_mask, seed, *ctx.params, compute_dbias,
        torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv, (dbias if compute_dbias else None), None, None, None, None, None, None


def _forward_backward(ctx, dout, _dlse):
    return _backward_with(ctx, dout, torch.ops.flash.attention_backward)


attention_forward.register_autograd(_forward_backward, setup_context=_forward_setup_context)


class _DirectAttention(torch.autograd.Function):
    """flash::attention_forward and its registered autograd, minus the dispatcher (ops/_eager.py)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _attention_forward_impl(*inputs, launch=plain_launch)
        _forward_setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, _dlse):
        return _backward_with(ctx, dout, functools.partial(_attention_backward_impl, launch=plain_launch))


@triton_op("flash::attention_varlen_forward", mutates_args=())
def attention_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                             seed: torch.Tensor | None, dropout_p: float, scale: float, window_left: int,
                             window_right: int, bottom_right: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (T, H, D) sequences; out (Tq, H, D) and logsumexp (H, Tq) fp32."""
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    if _kernels_enabled(q) and _kernel_supports(q, k, v, None):
        from flash_backend.kernels.attention_fwd import attention_varlen_forward_launch

        attention_varlen_forward_launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        seed, dropout_p, scale, window_left, window_right, bottom_right,
                                        out, lse)
        return out, lse
    ref_out, ref_lse = attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, seed, dropout_p,
                                                  scale, window_left, window_right, bottom_right)
    # results returned, not copied into the buffers: ops/_outputs.py says why
    return as_output(ref_out, out), as_output(ref_lse, lse)


@attention_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, dropout_p, scale, window_left,
      window_right, bottom_right):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@triton_op("flash::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              seed: torch.Tensor | None, dropout_p: float, scale: float, window_left: int,
                              window_right: int, bottom_right: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if _kernels_enabled(q) and _kernel_supports(q, k, v, None):
        from flash_backend.kernels.attention_bwd import attention_varlen_backward_launch

        attention_varlen_backward_launch(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, seed, dropout_p, scale, window_left, window_right,
                                         bottom_right, dq, dk, dv)
        return dq, dk, dv
    rdq, rdk, rdv = attention_varlen_backward_reference(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                        seed, dropout_p, scale, window_left, window_right,
                                                        bottom_right)
    # results returned, not copied into the buffers: ops/_outputs.py says why
    return as_output(rdq, dq), as_output(rdk, dk), as_output(rdv, dv)


@attention_varlen_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, dropout_p, scale,
      window_left, window_right, bottom_right):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, seed, *params = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, cu_q, cu_k, seed, out, lse)
    ctx.max_seqlens = (max_q, max_k)
    ctx.params = tuple(params)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zeros for lse's grad, as _forward_setup_context


def _varlen_backward(ctx, dout, _dlse):
    if dout is None:
        return (None,) * 13
    q, k, v, cu_q, cu_k, seed, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.flash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                           *ctx.max_seqlens, seed, *ctx.params)
    return (dq, dk, dv) + (None,) * 10


attention_varlen_forward.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# --------------------------------------------------------------------------------------------------------
# Validation and the public functions.
# --------------------------------------------------------------------------------------------------------


def _check_qkv(q, k, v, dims):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attention: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"flash_attention: {name} must be {dims}-d, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"flash_attention: {name}.dtype must be float16, bfloat16, float32 or float64, "
                            f"got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"flash_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k, v must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}")
    for name, t in (("q", q), ("v", v)):
        d = t.shape[-1]
        if d > MAX_HEAD_DIM or d % 8 != 0 or d == 0:
            raise ValueError(f"flash_attention: head_dim of {name} must be a multiple of 8 and at most "
                             f"{MAX_HEAD_DIM}, got {d}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"flash_attention: head_dim of q ({q.shape[-1]}) and k ({k.shape[-1]}) differ")


def _check_heads(hq, hk, hv):
    if hk != hv:
        raise ValueError(f"flash_attention: k and v must have the same number of heads, got {hk} and {hv}")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"flash_attention: the number of heads of q ({hq}) must be divisible by the number "
                         f"of heads of k/v ({hk})")


def _check_common(dropout_p, causal_alignment, window_size):
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"flash_attention: dropout_p must be in [0, 1), got {dropout_p}")
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"flash_attention: causal_alignment must be 'top_left' or 'bottom_right', got "
                         f"{causal_alignment!r}")
    if len(window_size) != 2 or any(int(w) != w or w < -1 for w in window_size):
        raise ValueError(f"flash_attention: window_size must be (left, right) ints >= -1, got {window_size}")


def _window(is_causal, window_size):
    left, right = int(window_size[0]), int(window_size[1])
    if is_causal:
        right = 0
    return left, right


def _seed(dropout_p, device):
    if dropout_p == 0.0:
        return None
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def _prepare_mask(attn_mask, q, k):
    if attn_mask is None:
        return None
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"flash_attention: attn_mask must be a tensor or None, got "
                        f"{type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"flash_attention: attn_mask must be bool or floating point, got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"flash_attention: attn_mask is on {attn_mask.device}, q on {q.device}")
    full = (B, H, Sq, Sk)
    padded = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
    if attn_mask.dim() > 4 or any(s not in (1, f) for s, f in zip(padded, full, strict=True)):
        raise ValueError(f"flash_attention: attn_mask of shape {tuple(attn_mask.shape)} is not broadcastable "
                         f"to (B, H, Sq, Sk) = {full}")
    return attn_mask.view((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))


def _mean_on_masked_rows(out, lse, v):
    """out with each row that saw no key (logsumexp +inf) replaced by the mean of v over all its keys, in the
    kernels' GQA grouping (query head h reads k/v head h // (Hq / Hk)).

    That is eager's row where one finite fill (-1e4, finfo.min) masks every key: the scores are all the
    fill, the softmax uniform. The gradients follow: v gets the mean's (dout / Sk per key) and q, k nothing
    from such rows, as in eager, where the fill cut the scores off. lse only selects (no gradient)."""
    if v.shape[2] == 0:
        return out  # no keys at all: eager's softmax over none, then ·v, gives 0 too
    batch, kv_heads, _, dv = v.shape
    group = out.shape[1] // kv_heads
    mean = v.mean(2, keepdim=True)[:, :, None].expand(batch, kv_heads, group, 1, dv)
    return torch.where(torch.isposinf(lse)[..., None], mean.reshape(batch, kv_heads * group, 1, dv), out)


def flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
                    causal_alignment="top_left", window_size=(-1, -1), fully_masked_rows="zero"):
    """F.scaled_dot_product_attention on (B, H, S, D) tensors, computed by the flash kernels.

    k/v may have fewer heads than q (any divisor, enable_gqa or not: no copy is made). is_causal is
    top-left aligned like SDPA unless causal_alignment="bottom_right" (FlashAttention's convention);
    causal_alignment also anchors window_size=(left, right). A query row with no visible key gives zeros,
    or with fully_masked_rows="mean" the mean of v over all keys (undropped): what eager's softmax gives
    when one finite fill such as -1e4 masks every key of the row (fx_passes/attention.py asks for it there).
    """
    if fully_masked_rows not in ("zero", "mean"):
        raise ValueError(f"flash_attention: fully_masked_rows must be 'zero' or 'mean', got "
                         f"{fully_masked_rows!r}")
    _check_qkv(q, k, v, 4)
    refuse_forward_ad("flash_attention", q, k, v, attn_mask)
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"flash_attention: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, "
                         f"v {v.shape[0]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"flash_attention: k and v sequence lengths differ: {k.shape[2]} and {v.shape[2]}")
    _check_heads(q.shape[1], k.shape[1], v.shape[1])
    _check_common(dropout_p, causal_alignment, window_size)
    if is_causal and attn_mask is not None:
        raise ValueError("flash_attention: pass either attn_mask or is_causal=True, not both (as SDPA)")
    mask = _prepare_mask(attn_mask, q, k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    left, right = _window(is_causal, window_size)
    seed = _seed(dropout_p, q.device)
    inputs = (q, k, v, mask, seed, float(dropout_p), scale, left, right, causal_alignment == "bottom_right")
    if direct_call_ok(q, k, v, mask) and _kernels_enabled(q) and _kernel_supports(q, k, v, mask):
        if needs_autograd(q, k, v, mask):
            out, lse = _DirectAttention.apply(*inputs)
        else:
            out, lse = _attention_forward_impl(*inputs, launch=plain_launch)
    else:
        out, lse = torch.ops.flash.attention_forward(*inputs)
    return _mean_on_masked_rows(out, lse, v) if fully_masked_rows == "mean" else out


def _assert_longest_fits(cu_seqlens, max_seqlen, total, which: str) -> None:
    """Every sequence of cu_seqlens at most max_seqlen long. The kernels size their grid by max_seqlen: a
    longer sequence's rows past it were left unwritten (FlashAttention's contract too, unchecked there).
    Checked without reading device memory on the host (torch._assert_async: an error on the CPU, a
    device-side assert on CUDA), so that it costs no sync and no graph break.

    Also that cu_seqlens are offsets into the `total` packed tokens: 0 first, never decreasing, `total`
    last. Offsets that did not start at 0 or decreased were taken silently (the reference gave tokens
    before the first offset to the last sequence, a wrong result) and a last offset past the tokens
    made the kernels read past q/k/v; one short of them raised an IndexError from inside the reference."""
    lengths = torch.diff(cu_seqlens) if cu_seqlens.shape[0] > 1 else None
    offsets_ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == total)
    if lengths is not None:
        offsets_ok = offsets_ok & (lengths.amin() >= 0)
    torch._assert_async(offsets_ok, f"flash_attention_varlen: cu_seqlens_{which} must start at 0, never "
                                    f"decrease and end at {which}.shape[0] (the number of packed tokens)")
    if lengths is not None:
        torch._assert_async(lengths.amax() <= max_seqlen,
                            f"flash_attention_varlen: a sequence of cu_seqlens_{which} is longer than "
                            f"max_seqlen_{which}")


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           is_causal=False, scale=None, *, causal_alignment="bottom_right",
                           window_size=(-1, -1)):
    """Attention over packed sequences: q (total_q, Hq, D), k/v (total_k, Hkv, D), cu_seqlens int32 (B+1).

    max_seqlen_* are Python (or symbolic) ints: nothing here reads device memory. causal_alignment
    defaults to bottom-right, FlashAttention's varlen convention.
    """
    _check_qkv(q, k, v, 3)
    refuse_forward_ad("flash_attention_varlen", q, k, v)
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"flash_attention_varlen: k and v token counts differ: {k.shape[0]} and "
                         f"{v.shape[0]}")
    if v.shape[-1] != q.shape[-1]:
        # out is allocated like q: another v head dim failed inside the op's body (after the work)
        raise ValueError(f"flash_attention_varlen: head_dim of v ({v.shape[-1]}) must equal that of q "
                         f"({q.shape[-1]})")
    _check_heads(q.shape[1], k.shape[1], v.shape[1])
    _check_common(dropout_p, causal_alignment, window_size)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):  # (a list raised AttributeError: 'list' has no 'dtype')
            raise TypeError(f"flash_attention_varlen: {name} must be a 1-d int32 tensor, got "
                            f"{type(cu).__name__}")
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device or cu.shape[0] == 0:
            raise ValueError(f"flash_attention_varlen: {name} must be a non-empty 1-d int32 tensor on "
                             f"{q.device}, got {cu.dtype} {tuple(cu.shape)} on {cu.device}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError("flash_attention_varlen: cu_seqlens_q and cu_seqlens_k must have the same length")
    _assert_longest_fits(cu_seqlens_q, max_seqlen_q, q.shape[0], "q")
    _assert_longest_fits(cu_seqlens_k, max_seqlen_k, k.shape[0], "k")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    left, right = _window(is_causal, window_size)
    seed = _seed(dropout_p, q.device)
    out, _ = torch.ops.flash.attention_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, float(dropout_p), scale, left,
        right, causal_alignment == "bottom_right")
    return out
