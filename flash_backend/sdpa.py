"""flash_backend as an SDPA backend: F.scaled_dot_product_attention on CUDA runs the flash attention op.

    import flash_backend.sdpa                      # registers the impl "flash_backend"; activates nothing
    torch.nn.attention.activate_flash_attention_impl("flash_backend")
    ...                                            # every SDPA call on CUDA, eager or compiled
    torch.nn.attention.restore_flash_attention_impl()   # PyTorch's kernels again

Trade-off: SDPA picks its kernel (flash, memory-efficient, cuDNN, math) inside ATen, after autograd. We
override the CUDA kernels of the three fused choices (forward and backward) at the dispatcher, as
torch/nn/attention/_fa4.py does for the flash one, rather than SDPA itself: autograd, the backend
selection, Inductor's extern calls and their fake shapes all stay PyTorch's, so eager and compiled code
take the same path, also where cuDNN would have been picked. The cost is that each override must return
exactly what its ATen op returns (layout of out, shape of logsumexp, seed/offset slots); it allocates
that and copies into it when the op's own allocation differs. Input the kernel cannot take (fp32,
head dims, dropout: the aten seed/offset slots cannot carry our RNG state between forward and backward)
goes to the original kernel captured before overriding (never back into the overridden op), with the
reason logged once. Forward and backward decide with the same predicate, so a pair never mixes kernels
(except a flash forward with return_debug_mask, which only the original can fill: its backward is ours).

Semantics are each aten op's: is_causal is top-left for the efficient and cuDNN ops (SDPA's), bottom-right
for the flash op (FlashAttention-2's; SDPA sends it square causal calls only, causal_lower_right non-square
ones); masks arrive as SDPA prepared them (bool converted to additive, expanded for the efficient op, as
given for cuDNN). A query row whose keys are all masked (-inf) gives 0 and zero gradients, as SDPA's math
path does; PyTorch's fused kernels may not (a finite fill such as cuDNN's for bool masks is not a mask).
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger("flash_backend")

IMPL_NAME = "flash_backend"

_FORWARD_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
_BACKWARD_OPS = (
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
)

_logged_reasons: set[str] = set()
_originals: dict[str, object] = {}
_active_handle: _Handle | None = None
calls = {"flash": 0, "fallback": 0}  # kernels run since activation; tests and benchmarks read it


# --------------------------------------------------------------------------------------------------------
# What the kernel takes
# --------------------------------------------------------------------------------------------------------


def unsupported_reason(query, key, value, attn_bias=None, dropout_p=0.0) -> str | None:
    """None when the flash kernel computes this SDPA call, else why PyTorch's kernel must."""
    from flash_backend.ops.attention import MAX_HEAD_DIM

    if dropout_p > 0.0:
        return "dropout_p > 0 (the aten seed/offset slots cannot carry the flash RNG state)"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return f"{query.dim()}-d inputs (the kernel takes (B, H, S, D))"
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {query.dtype} (the kernel takes float16 and bfloat16)"
    d, dv = query.shape[-1], value.shape[-1]
    if d != key.shape[-1] or d != dv:
        return f"head dims q {d}, k {key.shape[-1]}, v {dv} differ"
    if d % 8 or d > MAX_HEAD_DIM or d == 0:  # 0 passes `d % 8 == 0`; the kernel has no empty tile
        return f"head_dim {d} (the kernel takes multiples of 8 from 8 up to {MAX_HEAD_DIM})"
    if key.shape[1] == 0 or query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1]:
        return f"heads q {query.shape[1]}, k {key.shape[1]}, v {value.shape[1]}"
    if not (query.shape[0] == key.shape[0] == value.shape[0]):
        return "batch sizes differ"
    # B or S = 0: nothing to gain, and what such a call gives (or raises) is PyTorch's kernel's to say.
    if query.numel() == 0 or key.numel() == 0:
        return f"empty inputs: q {tuple(query.shape)}, k {tuple(key.shape)}"
    # SDPA rejects these before its kernels; a direct call of the aten op must get the aten op's error, not a
    # kernel reading past v or a mask it cannot address.
    if key.shape[2] != value.shape[2]:
        return f"k and v sequence lengths differ: {key.shape[2]} and {value.shape[2]}"
    if attn_bias is not None and attn_bias.device != query.device:
        return f"attn_bias on device {attn_bias.device}, query on {query.device}"
    if attn_bias is not None:
        full = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        if attn_bias.dim() > 4 or any(
            s not in (1, f) for s, f in zip(reversed(attn_bias.shape), reversed(full), strict=False)
        ):
            return f"attn_bias of shape {tuple(attn_bias.shape)} does not broadcast to {full}"
        if attn_bias.dtype not in (torch.bool, torch.float16, torch.bfloat16, torch.float32):
            return f"attn_bias dtype {attn_bias.dtype}"
    return None


def _use_flash(op: str, *args, **kwargs) -> bool:
    reason = unsupported_reason(*args, **kwargs)
    if reason is None:
        calls["flash"] += 1
        return True
    calls["fallback"] += 1
    if (op, reason) not in _logged_reasons:
        _logged_reasons.add((op, reason))
        log.info("flash_backend SDPA: %s runs PyTorch's kernel: %s", op, reason)
    return False


def _original(op: str):
    kernel = _originals.get(op)
    if kernel is None:
        raise RuntimeError(f"flash_backend SDPA: no original CUDA kernel of aten::{op} to fall back to")
    return kernel


# --------------------------------------------------------------------------------------------------------
# Shared forward / backward on the flash op
# --------------------------------------------------------------------------------------------------------


def _scale(query, scale):
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)


def _bias4(attn_bias):
    if attn_bias is None:
        return None
    return attn_bias.view((1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape))


# Where is_causal puts the diagonal when Sq != Sk differs between the ops: the efficient and cuDNN ops
# align it top-left (SDPA's documented causal), FlashAttention-2's op bottom-right. SDPA never sends a
# non-square causal call to the flash op, but torch.nn.attention.bias.causal_lower_right calls that op
# directly with Sq != Sk and relies on its bottom-right meaning; with Sq == Sk the two agree.
_FLASH_OP_BOTTOM_RIGHT = True


def _forward(query, key, value, attn_bias, is_causal, scale, bottom_right=False):
    return torch.ops.flash.attention_forward(
        query,
        key,
        value,
        _bias4(attn_bias),
        None,
        0.0,
        _scale(query, scale),
        -1,
        0 if is_causal else -1,
        bottom_right,
    )


def _backward(
    grad_out, query, key, value, out, lse, attn_bias, is_causal, scale, compute_dbias, bottom_right=False
):
    return torch.ops.flash.attention_backward(
        grad_out,
        query,
        key,
        value,
        out,
        lse,
        _bias4(attn_bias),
        None,
        0.0,
        _scale(query, scale),
        -1,
        0 if is_causal else -1,
        bottom_right,
        compute_dbias,
        torch.are_deterministic_algorithms_enabled(),
    )


def _into(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """result in like's exact layout (what the aten op's fake allocated)."""
    if result.stride() == like.stride():
        return result
    like.copy_(result)
    return like


def _seed_pair(device, dtype):
    return torch.zeros((), dtype=dtype, device=device), torch.zeros((), dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------------------
# The overrides (signatures as in native_functions.yaml)
# --------------------------------------------------------------------------------------------------------


def _flash_fwd(
    keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None
):
    op = _FORWARD_OPS[0]
    if return_debug_mask or not _use_flash(op, query, key, value, None, dropout_p):
        return _original(op).call_boxed(
            keyset, query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale
        )
    out, lse = _forward(query, key, value, None, is_causal, scale, _FLASH_OP_BOTTOM_RIGHT)
    out = _into(out, torch.empty_like(query))
    rng_state = torch.zeros(2, dtype=torch.uint64, device=query.device)
    unused = torch.zeros((), dtype=torch.uint64, device=query.device)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, lse, None, None, query.shape[2], key.shape[2], rng_state, unused, debug


def _flash_bwd(
    keyset,
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    *,
    scale=None,
):
    op = _BACKWARD_OPS[0]
    if not _use_flash(op, query, key, value, None, dropout_p):
        return _original(op).call_boxed(
            keyset,
            grad_out,
            query,
            key,
            value,
            out,
            logsumexp,
            cum_seq_q,
            cum_seq_k,
            max_q,
            max_k,
            dropout_p,
            is_causal,
            philox_seed,
            philox_offset,
            scale=scale,
        )
    dq, dk, dv, _ = _backward(
        grad_out, query, key, value, out, logsumexp, None, is_causal, scale, False, _FLASH_OP_BOTTOM_RIGHT
    )
    return (
        _into(dq, torch.empty_like(query)),
        _into(dk, torch.empty_like(key)),
        _into(dv, torch.empty_like(value)),
    )


def _efficient_fwd(
    keyset, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None
):
    op = _FORWARD_OPS[1]
    if not _use_flash(op, query, key, value, attn_bias, dropout_p):
        return _original(op).call_boxed(
            keyset, query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale=scale
        )
    B, H, Sq, _ = query.shape
    out, lse = _forward(query, key, value, attn_bias, is_causal, scale)
    res = torch.empty(B, Sq, H, value.shape[-1], dtype=query.dtype, device=query.device).transpose(1, 2)
    out = _into(out, res)
    lse_out = torch.empty(
        B, H, math.ceil(Sq / 32) * 32 if compute_log_sumexp else 0, dtype=torch.float32, device=query.device
    )
    if compute_log_sumexp:
        lse_out[..., :Sq].copy_(lse)
    seed, offset = _seed_pair(query.device, torch.int64)
    return out, lse_out, seed, offset


def _efficient_bwd(
    keyset,
    grad_out,
    query,
    key,
    value,
    attn_bias,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    dropout_p,
    grad_input_mask,
    is_causal=False,
    *,
    scale=None,
):
    op = _BACKWARD_OPS[1]
    if not _use_flash(op, query, key, value, attn_bias, dropout_p):
        return _original(op).call_boxed(
            keyset,
            grad_out,
            query,
            key,
            value,
            attn_bias,
            out,
            logsumexp,
            philox_seed,
            philox_offset,
            dropout_p,
            grad_input_mask,
            is_causal,
            scale=scale,
        )
    compute_dbias = attn_bias is not None and bool(grad_input_mask[3])
    if logsumexp.shape[-1] < query.shape[2]:
        # SDPA asks the forward for no logsumexp when only attn_mask requires grad (q, k, v do not;
        # pytorch#148476, where PyTorch's own kernel then reads past the empty tensor): recompute it.
        _, lse = _forward(query, key, value, attn_bias, is_causal, scale)
    else:
        lse = logsumexp[..., : query.shape[2]]
    dq, dk, dv, dbias = _backward(
        grad_out, query, key, value, out, lse, attn_bias, is_causal, scale, compute_dbias
    )

    def bshd(t, like):
        b, h, s, d = like.shape
        return _into(t, torch.empty(b, s, h, d, dtype=like.dtype, device=like.device).transpose(1, 2))

    grad_bias = None
    if compute_dbias:
        last = attn_bias.shape[-1]
        aligned = last if last % 16 == 0 else last + 16 - last % 16
        grad_bias = torch.empty(
            *attn_bias.shape[:-1], aligned, dtype=attn_bias.dtype, device=attn_bias.device
        )[..., :last]
        grad_bias.copy_(dbias.reshape(attn_bias.shape))
    return bshd(dq, query), bshd(dk, key), bshd(dv, value), grad_bias


def _cudnn_fwd(
    keyset,
    query,
    key,
    value,
    attn_bias,
    compute_log_sumexp,
    dropout_p=0.0,
    is_causal=False,
    return_debug_mask=False,
    *,
    scale=None,
):
    op = _FORWARD_OPS[2]
    if return_debug_mask or not _use_flash(op, query, key, value, attn_bias, dropout_p):
        return _original(op).call_boxed(
            keyset,
            query,
            key,
            value,
            attn_bias,
            compute_log_sumexp,
            dropout_p,
            is_causal,
            return_debug_mask,
            scale=scale,
        )
    out, lse = _forward(query, key, value, attn_bias, is_causal, scale)
    out = _into(out, _like_layout(query, value.shape[-1]))
    seed, offset = _seed_pair(query.device, torch.int64)
    return out, lse.unsqueeze(-1), None, None, query.shape[2], key.shape[2], seed, offset, None


def _cudnn_bwd(
    keyset,
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    attn_bias,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    *,
    scale=None,
):
    op = _BACKWARD_OPS[2]
    if not _use_flash(op, query, key, value, attn_bias, dropout_p):
        return _original(op).call_boxed(
            keyset,
            grad_out,
            query,
            key,
            value,
            out,
            logsumexp,
            philox_seed,
            philox_offset,
            attn_bias,
            cum_seq_q,
            cum_seq_k,
            max_q,
            max_k,
            dropout_p,
            is_causal,
            scale=scale,
        )
    lse = logsumexp.reshape(logsumexp.shape[:3])
    dq, dk, dv, _ = _backward(grad_out, query, key, value, out, lse, attn_bias, is_causal, scale, False)
    return (
        _into(dq, torch.empty_like(query)),
        _into(dk, torch.empty_like(key)),
        _into(dv, torch.empty_like(value)),
    )


def _like_layout(query, dv):
    """alloc_with_matching_layout of torch/_meta_registrations: query's dim order, v's head dim."""
    shape = tuple(query.shape[:-1]) + (dv,)
    order = sorted(range(query.dim()), key=lambda i: query.stride(i), reverse=True)
    return torch.empty_permuted(shape, order, dtype=query.dtype, device=query.device)


_IMPLS = {
    _FORWARD_OPS[0]: _flash_fwd,
    _BACKWARD_OPS[0]: _flash_bwd,
    _FORWARD_OPS[1]: _efficient_fwd,
    _BACKWARD_OPS[1]: _efficient_bwd,
    _FORWARD_OPS[2]: _cudnn_fwd,
    _BACKWARD_OPS[2]: _cudnn_bwd,
}


# --------------------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------------------


class _Handle:
    """Keeps the override library alive; remove() drops it, which gives the CUDA keys back to ATen."""

    def __init__(self, library):
        self.library = library

    def remove(self) -> None:
        global _active_handle
        if self.library is not None:
            self.library._destroy()
            self.library = None
        _originals.clear()
        if _active_handle is self:
            _active_handle = None


def register_kernels() -> _Handle:
    """The register_fn of the impl: override the fused SDPA CUDA kernels with the flash op's."""
    global _active_handle
    if not hasattr(torch.library, "get_kernel"):
        raise RuntimeError(
            f"flash_backend SDPA needs torch.library.get_kernel (torch >= 2.9); torch "
            f"{torch.__version__} lacks it"
        )
    import flash_backend.ops  # noqa: F401  (torch.ops.flash.*)

    if _active_handle is not None:
        _active_handle.remove()
    _originals.clear()
    for op in _IMPLS:
        try:
            _originals[op] = torch.library.get_kernel(f"aten::{op}", "CUDA")
        except RuntimeError:  # a CPU-only build has no CUDA kernel: nothing to fall back to, nothing to run
            _originals[op] = None
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - overriding aten kernels is the point
    for op, fn in _IMPLS.items():
        lib.impl(op, fn, "CUDA", with_keyset=True)
    calls.update(flash=0, fallback=0)
    _logged_reasons.clear()
    _active_handle = _Handle(lib)
    log.info("flash_backend SDPA: activated (%s)", ", ".join(_IMPLS))
    return _active_handle


def is_active() -> bool:
    return _active_handle is not None and _active_handle.library is not None


def deactivate() -> None:
    """PyTorch's kernels back, on torch versions whose registry has no restore_flash_attention_impl."""
    restore = getattr(torch.nn.attention, "restore_flash_attention_impl", None)
    if restore is not None:
        restore()
        return
    if _active_handle is not None:
        _active_handle.remove()
    from torch.nn.attention import _registry

    if getattr(_registry, "_FLASH_ATTENTION_ACTIVE", None) == IMPL_NAME:
        _registry._FLASH_ATTENTION_ACTIVE = None
        getattr(_registry, "_FLASH_ATTENTION_HANDLES", {}).pop(IMPL_NAME, None)


def _register_impl() -> None:
    register = getattr(torch.nn.attention, "register_flash_attention_impl", None)
    if register is None:
        log.info(
            "flash_backend SDPA: torch %s has no torch.nn.attention.register_flash_attention_impl; "
            "the SDPA backend is unavailable",
            torch.__version__,
        )
        return
    register(IMPL_NAME, register_fn=register_kernels)


_register_impl()
