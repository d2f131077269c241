"""Linear + cross-entropy, forward and backward: `torch.ops.flash.linear_cross_entropy_fwd` / `_bwd`.

What a language-model head spends, and what this op saves. `F.cross_entropy(F.linear(h, W, b).view(-1, V),
labels)` with V = 30522 (BERT) or 50257 (GPT-2) classes materialises (M, V) logits, the largest tensor of the
step, and moves them several times: the bias add, log-softmax forward and backward, and because V is not a
multiple of 8, Inductor copies the (M, V) gradient into a padded buffer so that the weight- and input-gradient
GEMMs get 16-byte aligned rows. Here:

- the GEMM runs on the weight padded with zero rows to `padded_classes(V)` (a copy of the weight, not of
  anything (M, V)-sized): every GEMM dimension is then a multiple of 8, which cuBLASLt needs for its fast
  kernels (with V = 50257 as the GEMM's row count it measured 4x slower on the H200). It writes the logits
  once, with the bias added in its epilogue (cuBLASLt BIAS, csrc/dense_gelu.cpp); the returned (..., V)
  logits are a view of those padded rows (row stride `padded_classes(V)`, as Inductor's own padded logits);
- the forward reads them once (one Triton pass: logsumexp, target logit, label smoothing's mean);
- the backward reads them once and writes the gradient once, into padded rows whose padding is zero, which
  both GEMMs then read whole; the same pass sums the gradient's columns for the bias gradient (cuBLASLt's
  BGRADB ran that as a separate 0.46 ms kernel at BERT's head on the H200, re-reading the 1 GB gradient).

The logits stay an output: models return them (transformers' `.logits`), and a gradient reaching them (a
distillation loss, or the zeros AOTAutograd feeds an unused output) is added in the same backward pass.

Semantics are F.cross_entropy's for class-index targets without class weights: `ignore_index` rows have
loss 0 and gradient 0, `reduction` is "mean" (over the rows not ignored), "sum" or "none", and
`label_smoothing` eps mixes the one-hot target with eps/V uniform. The loss is computed in fp32 whatever
the logits' dtype, and returned in the dtype the cross-entropy saw (`loss_dtype`: fp32 when the model
upcast its logits first, as transformers' causal-LM loss does). A target outside [0, V) that is not
ignore_index raises on the CPU path, as PyTorch does; the CUDA kernel cannot raise and makes that row's
loss NaN instead.

Paths. CUDA: the Triton passes; the forward GEMM by cuBLASLt for fp16/bf16 with K a multiple of 8, by
PyTorch otherwise; the backward GEMMs by PyTorch on the padded rows.
CPU: the plain-PyTorch reference (also what the fake mirrors: same padded rows).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import triton_op

from flash_backend._host_math import cdiv, next_power_of_2
from flash_backend._traced_launch import traced_launch
from flash_backend.kernels.cross_entropy_kernels import _cross_entropy_bwd_kernel, _cross_entropy_fwd_kernel
from flash_backend.ops._eager import plain_launch
from flash_backend.ops._forward_ad import refuse_forward_ad
from flash_backend.ops._outputs import as_output
from flash_backend.ops.dense import cublaslt_ready

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "padded_classes"]

REDUCTIONS = ("mean", "sum", "none")
_TARGET_DTYPES = (torch.int64, torch.int32)


def padded_classes(num_classes: int) -> int:
    """Row stride of the logits: the classes rounded up to a multiple of 8 (16-byte rows in fp16/bf16)."""
    return -(-num_classes // 8) * 8


def _empty_logits(rows: int, num_classes: int, like: Tensor) -> Tensor:
    return like.new_empty_strided((rows, num_classes), (padded_classes(num_classes), 1))


# --------------------------------------------------------------------------------------------------
# Reference (the CPU implementation)
# --------------------------------------------------------------------------------------------------


def linear_cross_entropy_reference(x: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                                   ignore_index: int = -100, label_smoothing: float = 0.0,
                                   upcast: bool = False, check_targets: bool = True
                                   ) -> tuple[Tensor, Tensor, Tensor]:
    """(logits (M, V), per-row loss (M,) fp32, logsumexp (M,) fp32) for x (M, K), weight (V, K), target (M,).

    The logits are in x's dtype (fp32 with `upcast`); the loss is computed from them in fp32. An ignored
    row has loss 0 and logsumexp 0: nothing reads it (its gradient is 0), so the kernel skips its logits.
    `check_targets=False` drops the explicit class-range check, a data-dependent branch that a traced graph
    cannot hold; there the gather of an out-of-range class raises instead.
    """
    if upcast:
        x, weight = x.float(), weight.float()
        bias = bias.float() if bias is not None else None
    logits = F.linear(x, weight, bias)
    z = logits.float()
    num_classes = z.shape[-1]
    ignored = target == ignore_index
    out_of_range = ~ignored & ((target < 0) | (target >= num_classes))
    if check_targets and out_of_range.any():
        raise IndexError(f"flash linear_cross_entropy: target holds class indices outside [0, {num_classes}) "
                         f"that are not ignore_index ({ignore_index})")
    lse = torch.logsumexp(z, dim=-1)
    target_logit = z.gather(-1, torch.where(ignored, 0, target).long()[:, None])[:, 0]
    loss = lse - (1.0 - label_smoothing) * target_logit
    if label_smoothing:
        loss = loss - label_smoothing * z.mean(-1)
    return logits, torch.where(ignored, 0.0, loss), torch.where(ignored, 0.0, lse)


def _grad_logits_reference(grad_loss: Tensor, grad_logits: Tensor | None, logits: Tensor, lse: Tensor,
                           target: Tensor, ignore_index: int, label_smoothing: float) -> Tensor:
    """d(loss rows)/d(logits) . grad_loss (+ grad_logits), in fp32."""
    z = logits.float()
    num_classes = z.shape[-1]
    ignored = target == ignore_index
    grad = torch.exp(z - lse[:, None]) - label_smoothing / num_classes
    onehot = F.one_hot(torch.where(ignored, 0, target).long(), num_classes).to(grad.dtype)
    grad = (grad - (1.0 - label_smoothing) * onehot) * grad_loss[:, None]
    grad = torch.where(ignored[:, None], 0.0, grad)
    return grad if grad_logits is None else grad + grad_logits.float()


# --------------------------------------------------------------------------------------------------
# Input checks: before any kernel, in the real kernels and in the fakes alike
# --------------------------------------------------------------------------------------------------


def _check_bwd(grad_loss: Tensor, grad_logits: Tensor | None, x: Tensor, weight: Tensor) -> None:
    where = "flash linear_cross_entropy backward"
    if tuple(grad_loss.shape) != (x.shape[0],):
        raise ValueError(f"{where}: grad_loss must have shape (M,) = ({x.shape[0]},), "
                         f"got {tuple(grad_loss.shape)}")
    expected = (x.shape[0], weight.shape[0])
    if grad_logits is not None and tuple(grad_logits.shape) != expected:
        raise ValueError(f"{where}: grad_logits must have shape (M, V) = {expected}, "
                         f"got {tuple(grad_logits.shape)}")


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, label_smoothing: float) -> None:
    where = "flash linear_cross_entropy"
    if not x.is_floating_point() or x.dim() != 2:
        raise ValueError(f"{where}: x must be a 2-D (M, K) floating-point tensor, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"{where}: weight must be (V, K) = (classes, {x.shape[1]}) like nn.Linear.weight, "
                         f"got {tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise ValueError(f"{where}: weight must have at least one class (row), got {tuple(weight.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{where}: {name} dtype {t.dtype} differs from x dtype {x.dtype}")
        if t is not None and t.device != x.device:
            raise ValueError(f"{where}: {name} is on {t.device} but x is on {x.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{where}: bias must have shape (V,) = ({weight.shape[0]},), "
                         f"got {tuple(bias.shape)}")
    if target.dtype not in _TARGET_DTYPES:
        raise TypeError(f"{where}: target must hold class indices as int64 or int32, got {target.dtype} "
                        "(class probabilities are not supported)")
    if tuple(target.shape) != (x.shape[0],):
        raise ValueError(f"{where}: target must have shape (M,) = ({x.shape[0]},), got {tuple(target.shape)}")
    if target.device != x.device:
        raise ValueError(f"{where}: target is on {target.device} but x is on {x.device}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{where}: label_smoothing must be in [0, 1], got {label_smoothing}")


# --------------------------------------------------------------------------------------------------
# Kernel launchers (also what the interpreter tests call on CPU tensors)
# --------------------------------------------------------------------------------------------------


def _fwd_config(num_classes: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps). H200, 16384 x 30522 bf16 (bench_cross_entropy.py --sweep): 1024 x 4 warps
    reads at 2.84 TB/s; 2048 x 8: 2.77; 4096 x 8: 1.79; 8192 x 16: 1.30."""
    block = min(1024, next_power_of_2(num_classes))
    return block, max(1, min(4, block // 256))


def _bwd_config(num_classes: int) -> tuple[int, int, int]:
    """(BLOCK_V, num_warps, rows per program). H200, same shape, reading logits and writing the gradient
    one row per program: 1024 x 8 warps 2.87 TB/s; 1024 x 4, 2048 x 4 or 8 and 4096 x 8: 0.98-1.09 TB/s.
    128 rows per program keeps BERT's 16384 rows at 3840 programs, and the fp32 partial column sums
    (one row of them per 128 rows) at 1/64 of the gradient's bytes."""
    block = min(1024, next_power_of_2(num_classes))
    return block, max(1, min(8, block // 128)), 128


def cross_entropy_fwd_launch(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float,
                             launch=plain_launch) -> tuple[Tensor, Tensor]:
    """(loss (M,) fp32, lse (M,) fp32) of logits (M, V) with unit column stride. `launch` wraps the kernel
    (traced_launch inside the ops' bodies)."""
    rows, num_classes = logits.shape
    loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(loss)
    if rows:
        block, warps = _fwd_config(num_classes)
        launch(_cross_entropy_fwd_kernel)[(rows,)](
            logits, target, loss, lse, logits.stride(0), num_classes, ignore_index, float(label_smoothing),
            BLOCK_V=block, NUM_CHUNKS=cdiv(num_classes, block), HAS_SMOOTHING=label_smoothing != 0.0,
            num_warps=warps)
    return loss, lse


def cross_entropy_bwd_launch(grad_loss: Tensor, grad_logits: Tensor | None, logits: Tensor, lse: Tensor,
                             target: Tensor, ignore_index: int, label_smoothing: float,
                             bias_grad: bool = False, launch=plain_launch) -> tuple[Tensor, Tensor | None]:
    """(the gradient of the logits in their dtype, as whole padded rows: (M, padded_classes(V)), the
    columns past V zero; with `bias_grad`, its column sums (V,) in fp32, else None). `launch` as for the
    forward."""
    rows, num_classes = logits.shape
    padded = padded_classes(num_classes)
    grad = logits.new_empty(rows, padded)
    block, warps, rows_per_group = _bwd_config(num_classes)
    groups = cdiv(rows, rows_per_group)
    partial = torch.zeros(groups if bias_grad else 0, padded, device=logits.device, dtype=torch.float32)
    if rows:
        chunks = cdiv(padded, block)
        grad_in = grad_logits if grad_logits is not None else grad  # unread unless HAS_GRAD_LOGITS
        launch(_cross_entropy_bwd_kernel)[(groups * chunks,)](
            grad, partial, logits, lse, target, grad_loss, grad_in, grad.stride(0), logits.stride(0),
            grad_loss.stride(0), grad_in.stride(0), rows, num_classes, padded, ignore_index,
            float(label_smoothing), rows_per_group, BLOCK_V=block, CHUNKS_PER_ROW=chunks,
            HAS_GRAD_LOGITS=grad_logits is not None, HAS_DBIAS=bias_grad, num_warps=warps)
    return grad, partial.sum(0)[:num_classes] if bias_grad else None


def _pad_classes(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """weight (V, K) and bias (V,) with zero rows appended up to padded_classes(V) (no copy if none)."""
    extra = padded_classes(weight.shape[0]) - weight.shape[0]
    weight = F.pad(weight, (0, 0, 0, extra)) if extra else weight.contiguous()
    if bias is not None:
        bias = F.pad(bias, (0, extra)) if extra else bias.contiguous()
    return weight, bias


def _cublaslt_forward(x: Tensor) -> bool:
    """cuBLASLt (csrc) for the forward GEMM: CUDA fp16/bf16 with K a multiple of 8 (16-byte rows); K = 0
    (which passes `% 8`) gets F.linear's answer, the bias."""
    return x.shape[1] % 8 == 0 and x.shape[1] > 0 and cublaslt_ready(x)


def _unit_columns(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# --------------------------------------------------------------------------------------------------
# The ops: flash::linear_cross_entropy_fwd / _bwd
#
# triton_op, not custom_op: under torch.compile the bodies are traced into the graph, so Inductor launches
# the Triton passes from its generated code and calls the GEMMs as extern kernels, instead of custom_op's
# Python dispatch and Triton's Python launcher per call (host time that a step whose GPU work is short, as
# ViT-base's, waits on: bench/NOTES_cross_entropy.md). Eager CPU calls take the CPU kernels registered
# below (the reference, with its check of the targets' values); traced on CPU, the body runs the reference
# without that check, a data-dependent branch a graph cannot hold.
# --------------------------------------------------------------------------------------------------


def _fwd_cpu(x, weight, bias, target, ignore_index, label_smoothing, check_targets=True):
    _check(x, weight, bias, target, label_smoothing)
    logits, loss, lse = linear_cross_entropy_reference(x, weight, bias, target, ignore_index, label_smoothing,
                                                       check_targets=check_targets)
    # the result returned, not copied into the padded buffer when it has its layout: ops/_outputs.py says why
    return as_output(logits, _empty_logits(*logits.shape, logits)), loss, lse


@triton_op("flash::linear_cross_entropy_fwd", mutates_args=())
def linear_cross_entropy_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                             ignore_index: int, label_smoothing: float) -> tuple[Tensor, Tensor, Tensor]:
    """x (M, K), weight (V, K), bias (V,) or None, target (M,) ->
    (logits (M, V) with rows padded to padded_classes(V), per-row loss (M,) fp32, logsumexp (M,) fp32)."""
    if x.device.type != "cuda":  # traced on CPU (eager CPU calls take the registered CPU kernel)
        return _fwd_cpu(x, weight, bias, target, ignore_index, label_smoothing, check_targets=False)
    _check(x, weight, bias, target, label_smoothing)
    num_classes = weight.shape[0]
    if _cublaslt_forward(x):
        logits = torch.ops.flash.cublaslt_linear(x.contiguous(), *_pad_classes(weight, bias))[:, :num_classes]
    else:
        logits = as_output(F.linear(x, weight, bias), _empty_logits(x.shape[0], num_classes, x))
    loss, lse = cross_entropy_fwd_launch(logits, target, ignore_index, label_smoothing, launch=traced_launch)
    return logits, loss, lse


@linear_cross_entropy_fwd.register_fake
def _(x, weight, bias, target, ignore_index, label_smoothing):
    _check(x, weight, bias, target, label_smoothing)
    rows = x.shape[0]
    stats = x.new_empty(rows, dtype=torch.float32)
    return _empty_logits(rows, weight.shape[0], x), stats, torch.empty_like(stats)


@triton_op("flash::linear_cross_entropy_bwd", mutates_args=())
def linear_cross_entropy_bwd(grad_loss: Tensor, grad_logits: Tensor | None, x: Tensor, weight: Tensor,
                             logits: Tensor, lse: Tensor, target: Tensor, ignore_index: int,
                             label_smoothing: float, has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """-> (grad_x (M, K), grad_weight (V, K), grad_bias (V,), or (0,) without a bias)."""
    if x.device.type != "cuda":  # traced on CPU (eager CPU calls take the registered CPU kernel)
        return _bwd_cpu(grad_loss, grad_logits, x, weight, logits, lse, target, ignore_index, label_smoothing,
                        has_bias)
    _check_bwd(grad_loss, grad_logits, x, weight)
    grad_logits = _unit_columns(grad_logits) if grad_logits is not None else None
    grad, grad_bias = cross_entropy_bwd_launch(grad_loss.float(), grad_logits, logits, lse, target,
                                               ignore_index, label_smoothing, bias_grad=has_bias,
                                               launch=traced_launch)
    grad_bias = grad_bias.to(x.dtype) if has_bias else x.new_empty(0)
    # The padded rows whole (zero past V) with the zero-padded weight: every GEMM dimension a multiple of 8.
    padded_weight, _ = _pad_classes(weight, None)
    return grad @ padded_weight, (grad.t() @ x)[:weight.shape[0]], grad_bias


def _bwd_cpu(grad_loss, grad_logits, x, weight, logits, lse, target, ignore_index, label_smoothing, has_bias):
    _check_bwd(grad_loss, grad_logits, x, weight)
    grad = _grad_logits_reference(grad_loss, grad_logits, logits, lse, target, ignore_index,
                                  label_smoothing).to(x.dtype)
    grad_bias = grad.sum(0) if has_bias else x.new_empty(0)
    return grad @ weight, grad.t() @ x, grad_bias


linear_cross_entropy_fwd.register_kernel("cpu")(_fwd_cpu)
linear_cross_entropy_bwd.register_kernel("cpu")(_bwd_cpu)


@linear_cross_entropy_bwd.register_fake
def _(grad_loss, grad_logits, x, weight, logits, lse, target, ignore_index, label_smoothing, has_bias):
    _check_bwd(grad_loss, grad_logits, x, weight)
    grad_bias = x.new_empty(weight.shape[0] if has_bias else 0)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), grad_bias


# --------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    x, weight, bias, target, ignore_index, label_smoothing = inputs
    logits, _, lse = output
    ctx.save_for_backward(x, weight, logits, lse, target)
    ctx.ignore_index, ctx.label_smoothing, ctx.has_bias = ignore_index, label_smoothing, bias is not None
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # an unused logits output costs no (M, V) zeros


def _backward(ctx, grad_logits, grad_loss, _grad_lse):
    x, weight, logits, lse, target = ctx.saved_tensors
    if grad_loss is None:
        grad_loss = lse.new_zeros(lse.shape)
    grad_x, grad_weight, grad_bias = torch.ops.flash.linear_cross_entropy_bwd(
        grad_loss, grad_logits, x, weight, logits, lse, target, ctx.ignore_index, ctx.label_smoothing,
        ctx.has_bias)
    return grad_x, grad_weight, grad_bias if ctx.has_bias else None, None, None, None


linear_cross_entropy_fwd.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# Public function (what the fx_passes rewrite emits)
# --------------------------------------------------------------------------------------------------


def linear_cross_entropy(x: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, *,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         loss_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """(loss, logits) where logits = F.linear(x, weight, bias), shape (..., V), and
    loss = F.cross_entropy(logits.to(loss_dtype).reshape(-1, V), target.reshape(-1), ignore_index=...,
    reduction=..., label_smoothing=...). loss_dtype defaults to x's dtype; the loss is computed in fp32."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"flash linear_cross_entropy: reduction must be one of {REDUCTIONS}, "
                         f"got {reduction!r}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("target", target)):
        if not isinstance(t, Tensor) and not (name == "bias" and t is None):  # not an AttributeError later
            raise TypeError(f"flash linear_cross_entropy: {name} must be a tensor, got {type(t).__name__}")
    if x.dim() < 1:
        raise ValueError("flash linear_cross_entropy: x must have at least one dimension (..., K)")
    if loss_dtype is not None and not loss_dtype.is_floating_point:
        raise TypeError(f"flash linear_cross_entropy: loss_dtype must be a floating-point dtype, got "
                        f"{loss_dtype}")
    refuse_forward_ad("linear_cross_entropy", x, weight, bias)
    num_classes = weight.shape[0]
    # rows spelled out, not -1: with K = 0 a (0-element) reshape(-1, 0) is ambiguous and raised
    x_rows, rows_target = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), target.reshape(-1)
    logits, loss_rows, _ = torch.ops.flash.linear_cross_entropy_fwd(x_rows, weight, bias, rows_target,
                                                                     ignore_index, float(label_smoothing))
    logits = logits.view(*x.shape[:-1], num_classes)
    loss_dtype = loss_dtype or x.dtype
    if reduction == "none":
        return loss_rows.to(loss_dtype), logits
    total = loss_rows.sum()
    if reduction == "mean":
        total = total / (rows_target != ignore_index).sum()  # 0 / 0 = NaN when every row is ignored, as eager
    return total.to(loss_dtype), logits
