"""Norm family: [dropout +] [residual add +] LayerNorm / RMSNorm [* weight + bias] -> flash add_dropout_norm.

Why: in every transformer block the residual stream goes through dropout, an add and a norm, each a
full read and write of the activations in eager mode and a separate kernel in the backward. The fused
op reads x and the residual once, writes the normalised output (and, for pre-norm blocks, the new
residual stream) once, and recomputes the dropout mask from its seed in the backward.

What is matched, on the Torch IR dynamo produces (before AOTAutograd, so the op's autograd gives the
backward): a *norm core* over the last dim — ``F.layer_norm`` / ``nn.LayerNorm``, ``F.rms_norm`` /
``nn.RMSNorm``, LayerNorm written out and RMSNorm written out:

- statistics: LayerNorm's mean and biased variance as ``mean`` + ``var(unbiased=False / correction=0)``,
  ``torch.var_mean(..)``, or the mean of the squared centred value (``** 2``, ``.pow(2)``, ``d * d``,
  ``square``); its standard deviation as ``std(unbiased=False)`` / ``std_mean`` (eps = 0); RMSNorm's mean
  of ``x**2`` / ``x*x`` / ``square`` (Llama, T5, Gemma), or the 2-norm scaled to a root mean square,
  ``x.norm(2, -1, keepdim=True) * N ** -0.5`` (also ``torch.norm``, ``linalg.vector_norm``, ``/ sqrt(N)``;
  eps = 0);
- a mean, wherever one is read (LayerNorm's mean and variance, RMSNorm's mean square), in any spelling
  ``_as_mean`` knows: ``mean`` (method or function, dim ``-1`` / ``[-1]`` / ``(-1,)``, keepdim by name or
  position, or by NumPy's names ``axis=`` / ``keepdims=``, which torch takes too, here and in every
  reduction below), a sum divided by the number of elements it adds, ``x.sum(-1, keepdim=True) / N`` or
  ``* (1 / N)``, N a number equal to the static size or the size itself (``x.shape[-1]``, ``x.size(-1)``,
  symbolic under dynamic shapes), and either reduced without keepdim then given the dim back
  (``x.mean(-1).unsqueeze(-1)``, ``[..., None]``). A sum over another count (``/ (N - 1)``, another dim's
  size) is another function and no candidate; a number over a symbolic size is reported (it is the size
  only for the example), and so is a float16 sum (it overflows past 65504 where the mean does not). A
  statistic reduced without keepdim may also get its last dim back on a ``var`` / ``std`` call itself
  (``x.var(-1, unbiased=False)[..., None]``) or after its root (``rsqrt(x.pow(2).mean(-1) + eps)[..., None]``,
  ``.unsqueeze(-1)``, ``[:, :, None]``), and so may both outputs of ``var_mean`` / ``std_mean``: the same
  values as keepdim=True;
- the scaling: ``* rsqrt(s + eps)`` (function or method), ``/ sqrt(s + eps)``, ``** ±0.5``, ``.pow(..)``,
  ``1 / sqrt(..)``, ``reciprocal(sqrt(..))``, eps on either side of the add; a weight row (below) may
  multiply the value being scaled (``w * (x - mean) / sqrt(var + eps)``);

widened to include

- upcasts of its input (``x.float()``) and casts of its output (``.to(input_dtype)``, ``.type_as``),
- a trailing ``* weight`` and (LayerNorm) ``+ bias`` of shape (N,), on either side, or
  ``torch.addcmul(bias, normalised, weight)``; also rows kept with leading singleton dims, (1, N) or
  (1, 1, N) (a parameter stored so, ``w.view(1, -1)``, ``w[None]``, ``w.unsqueeze(0)``), of at most the
  normalised value's rank: their broadcast is the (N,) row's, so the op reads ``w.reshape(-1)`` and autograd
  gives the gradient back in the parameter's shape. One of higher rank (a (1, N) weight on a 1-d x) adds
  dims to eager's output: reported, not rewritten. A weight that varies over the rows ((M, N), (B, 1, N))
  is no row and stays after the op,
- the tensor it normalises when that is ``dropout(x) + residual`` (either order), ``x + residual``
  or ``dropout(x)``; when that tensor has other users (pre-norm blocks), they read the op's
  residual output instead (``return_residual=True``). Also when the norm reads such a sum through views
  that move its rows whole, a transpose or permute of the dims before the last one, ``contiguous()``
  (OpenFold's column attention normalises ``m.transpose(-2, -3)`` of its residual sum): the op takes the
  sum's operands in their own layout and its output is permuted as the norm's input was (_through_row_views).

The trade-off is the one the pass contract asks for: only what is provably the same function is
rewritten. Structural facts (last dim only, keepdim, biased variance, constant eps and dropout p, no
intermediate with outside users, weight a row of N) are checked on the graph; the result dtype and shape
by running the fused op on the fake inputs, most fused form first (upcasts folded, whole affine tail),
then keeping an upcast as the op's input or leaving trailing casts / affine ops after the op, where they
run as eager ran them (a bf16 norm times an fp32 weight promotes there). When no form gives eager's
dtype and shape, or a structural check fails, the candidate is left alone whole, never silently
promoted, and reported with its reason. Look-alikes that are other functions are reported too: an unbiased
variance or standard deviation (``x.var(-1)``, ``var_mean`` / ``std`` defaults, ``correction=1``), eps added
after the square root (the Annotated Transformer's ``(x - mean) / (x.std(-1) + eps)``, ``sqrt(ms) + eps``),
eps added to or a clamp of the 2-norm's root mean square (``x / (norm * N ** -0.5 + eps)``, Zhang &
Sennrich's reference RMSNorm; ``.clamp(min=eps)``, lucidrains'). So is a pattern one of whose tensors is
written in place before it ends (dynamo reads it by one node before and after the write), or, where the
graph may record gradients, one the op saves for its backward (the pre-norm sum it returns, x when it stores
no sum, the weight and bias) written in place after it when eager saved another tensor (``h += f(norm(h))``
after a hand-written norm, which saves ``h - mean``: the op's backward would fail where eager's trains); an
in-place dropout of a tensor whose memory another node shares (``a.float()`` of an fp32 a, ``.detach()``:
eager's write reaches a). A cast that loses values (bf16 -> fp16 loses range) is never folded as an
upcast. Nor is a rounding of the result (``.bfloat16()``, or a bf16 ``w * x`` scaled in fp32) folded when a
later step widens it again (``* w_fp32``, ``.float()``): the op rounds once, to its output's dtype. Nor is
a hand-written statistic computed in float16 (its squares, a ``var`` / ``var_mean``, a 2-norm; not upcast
first): it overflows past 65504, a square once |x| > 256, where the fused op's fp32 statistics do not, and
eager's output is then 0 or NaN.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fx_passes._compat import restart_with_specialised_floats, stable_topological_sort
from fx_passes._match import (
    arg,
    binary_operands,
    binary_other,
    erase_unused,
    fake_call,
    fused_op,
    in_place_writers,
    insert_call,
    insert_getitem,
    is_number,
    is_op,
    norm_dim,
    op_name,
    out_writer,
    records_no_grad,
    state_crossing,
    tensor_meta,
    val,
    written_before_end,
)
from fx_passes._report import record_near_miss, record_rewrite

FAMILY = "norm"
# Before dense (50): with dynamic=True this pass may restart dynamo's analysis (see rewrite()), and a family
# that ran before it would have counted rewrites of a graph that is then thrown away.
ORDER = 40

_OP_MODULE = "flash_backend.ops.add_dropout_norm"
_OP_NAME = "flash.add_dropout_norm"
_CASTS = {"float", "half", "bfloat16", "double", "to", "type", "type_as"}


class _Miss(Exception):
    """A candidate that is not provably the same function; the message is the reason."""


@dataclass
class _Core:
    """A normalisation over the last dim, before widening to dropout/residual and weight/bias."""

    variant: str
    is_rms: bool
    x: torch.fx.Node  # the tensor being normalised (outermost input, before folded upcasts)
    upcasts: list[torch.fx.Node]  # casts between x and the statistics, innermost first
    eps: float
    weight: torch.fx.Node | None
    bias: torch.fx.Node | None
    out: torch.fx.Node  # the node holding the normalised (and affine) result
    anchor: torch.fx.Node
    inner: set[torch.fx.Node] = field(default_factory=set)  # nodes only the norm uses, out excluded
    # after out: (kind, node, operand) for "cast" / "weight" / "bias"; weight and bias above are the
    # norm call's own
    tail: list[tuple[str, torch.fx.Node, torch.fx.Node | tuple | None]] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------------
# Small predicates
# --------------------------------------------------------------------------------------------------------


def _same_size(a, b) -> bool:
    return a is b or statically_known_true(a == b)


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(_same_size(p, q) for p, q in zip(a.shape, b.shape, strict=True))


def _is_row(t: torch.Tensor | None, n, rank: int) -> bool:
    """t is a weight / bias row of the normalised size n that the op can take as t.reshape(-1): shape (n,),
    or (1, n) / (1, 1, n) (a parameter kept with leading singleton dims, ``w.view(1, -1)``, ``w[None]``),
    of at most `rank` dims, the rank of the normalised value it scales. It then broadcasts over that value's
    rows as the (n,) row does, giving the same values in the value's own shape; with more dims it would
    prepend them to the output's shape, which the op's does not have."""
    return t is not None and 1 <= t.dim() <= rank and _same_size(t.shape[-1], n) and all(
        _same_size(s, 1) for s in t.shape[:-1])


def _rank(node: torch.fx.Node) -> int:
    """The number of dims of the value node produces; 1 without metadata (only an (n,) row then fits)."""
    t = tensor_meta(node)
    return t.dim() if t is not None else 1


def _as_row(t):
    """The (n,) row the op takes for a weight / bias kept with leading singleton dims (see _is_row)."""
    return t.reshape(-1) if isinstance(t, torch.Tensor) and t.dim() > 1 else t


def _is_cast(node: object) -> bool:
    """A dtype conversion that keeps shape and device (x.float(), x.to(torch.bfloat16), x.type_as(y))."""
    if not isinstance(node, torch.fx.Node) or op_name(node) not in _CASTS or not node.args:
        return False
    src, dst = tensor_meta(node.args[0]), tensor_meta(node)
    return (
        src is not None and dst is not None and src.dtype.is_floating_point and dst.dtype.is_floating_point
        and src.device == dst.device and _same_shape(src, dst)
    )


def _same_value(a: object, b: object) -> bool:
    """a and b compute the same tensor: one node, or two spellings of one pure op (``(x - u)`` twice)."""
    if a is b:
        return True
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return False
    if op_name(a) not in _CASTS | {"sub"} or a.op != b.op or a.target != b.target:
        return False
    if len(a.args) != len(b.args) or a.kwargs != b.kwargs:
        return False
    return all(_same_value(p, q) if isinstance(p, torch.fx.Node) else p == q
               for p, q in zip(a.args, b.args, strict=True))


def _square_of(node: object):
    """Y when node is Y**2, Y*Y or Y.square(), else None."""
    if not isinstance(node, torch.fx.Node):
        return None
    if is_op(node, "pow") and len(node.args) == 2 and not node.kwargs and node.args[1] == 2:
        return node.args[0]
    pair = binary_operands(node, "mul")
    if pair is not None and _same_value(pair[0], pair[1]):
        return pair[0]
    if is_op(node, "square") and len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    return None


# torch's argument parser also takes NumPy's names for these (``x.mean(axis=-1, keepdims=True)``, code ported
# from NumPy / JAX): the same call, which must be read as such, not as a reduction over dim None.
_NUMPY_ALIASES = {"dim": "axis", "keepdim": "keepdims"}


def _kwarg(node: torch.fx.Node, index: int, name: str, default=None):
    """arg(node, index, name, default), or the argument given under its NumPy alias (axis=, keepdims=)."""
    alias = _NUMPY_ALIASES.get(name)
    if alias is not None and alias in node.kwargs:
        return node.kwargs[alias]
    return arg(node, index, name, default)


def _unsqueeze_pos(node: torch.fx.Node, of: torch.fx.Node | None = None):
    """d for ``t.unsqueeze(d)`` / ``torch.unsqueeze(t, dim=d)`` (``axis=d`` too) of t (of, when given), else
    None."""
    if not is_op(node, "unsqueeze") or not node.args or len(node.args) + len(node.kwargs) != 2 \
            or set(node.kwargs) - {"dim", "axis"} or (of is not None and node.args[0] is not of):
        return None
    return _kwarg(node, 1, "dim")


def _mean_spec(node: torch.fx.Node) -> tuple[object, bool, bool]:
    """(dim, keepdim, has_dtype) of a mean/var-like reduction."""
    return _kwarg(node, 1, "dim"), bool(_kwarg(node, 2, "keepdim", False)), "dtype" in node.kwargs


def _dims_text(dim) -> str:
    return str(tuple(dim)) if isinstance(dim, (list, tuple)) else str(dim)


def _check_last_dim(src: torch.fx.Node, dim, keepdim: bool, what: str) -> None:
    """The reduction of src over dim is over its last dim only, with keepdim."""
    t = tensor_meta(src)
    if t is None:
        raise _Miss(f"{what} has no shape/dtype metadata")
    ndim = t.dim()
    if norm_dim(dim, ndim) != ndim - 1:
        raise _Miss(f"{what} reduces over dim {_dims_text(dim)} of a {ndim}-d tensor, not only the last dim")
    if not keepdim:
        raise _Miss(f"{what} has no keepdim=True")


def _float16_reason(node: torch.fx.Node, what: str) -> str | None:
    """Why a statistic the hand-written norm computes in float16 is another function, or None.

    The squares ``x * x`` (and a variance, a 2-norm) rounded to float16 overflow past 65504, a square once
    |x| > 256, common in fp16 activations: eager's statistic is then inf and its output 0 or NaN. The fused
    op, like F.layer_norm / F.rms_norm, computes them in float32. (A sum of squares was already reported,
    see _sum_over_count; ``x - mean`` and a standard deviation overflow only for values near float16's own
    limit, where the input itself is out of range, and are left as they are.)"""
    t = tensor_meta(node)
    if t is None or t.dtype != torch.float16:
        return None
    return (f"{what} is computed in float16, which overflows past 65504 (a square once |x| > 256) where the "
            "fused op computes in float32: not the same function (upcast first, x.float(), as Llama's and "
            "T5's RMSNorm do)")


def _check_not_float16(node: torch.fx.Node, what: str) -> None:
    reason = _float16_reason(node, what)
    if reason is not None:
        raise _Miss(reason)


def _depends_on(node: torch.fx.Node, targets: set[torch.fx.Node]) -> bool:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


# The symbols of dynamo's float inputs (zf0, ...) that this run of the pass specialised; see rewrite().
_float_inputs_to_specialise: list = []


def _is_scalar(value: object) -> bool:
    """A Python number, or a node producing one (dynamic=True turns float attributes into SymFloats)."""
    return is_number(value) or isinstance(value, torch.fx.Node) and isinstance(
        val(value), (torch.SymFloat, torch.SymInt, float, int))


def _constant(value: object, what: str) -> float:
    """The value of a scalar argument. A SymFloat (dynamo's dynamic=True makes module float attributes
    like eps and dropout p graph inputs) is specialised: dynamo guards on it, so a change recompiles."""
    v = val(value) if isinstance(value, torch.fx.Node) else value
    if is_number(v):
        return float(v)
    if isinstance(v, (torch.SymFloat, torch.SymInt)):
        symbol = getattr(v.node, "_expr", None)
        try:
            constant = float(v)
        except Exception:  # noqa: BLE001 - data-dependent: no value to specialise on
            pass
        else:
            if isinstance(v, torch.SymFloat) and symbol is not None:
                _float_inputs_to_specialise.extend(symbol.free_symbols)
            return constant
    raise _Miss(f"{what} is not a constant number ({getattr(value, 'name', value)!r})")


def _opmath_eps(dtype: torch.dtype) -> float:
    """F.rms_norm's eps=None: the machine epsilon of the type it computes in (fp32 for fp16/bf16)."""
    return torch.finfo(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype).eps


# --------------------------------------------------------------------------------------------------------
# Norm cores
# --------------------------------------------------------------------------------------------------------


def _is_exact_cast(node: object) -> bool:
    """A cast every value survives: to a dtype that holds all of the source's (bf16 -> fp32, fp16 -> fp64),
    not merely one as wide (bf16 -> fp16 keeps the width but not the range: 1e5 becomes inf)."""
    if not _is_cast(node):
        return False
    src, dst = tensor_meta(node.args[0]).dtype, tensor_meta(node).dtype
    return torch.promote_types(src, dst) == dst


def _upcast_root(node: object) -> object:
    """node with its exact (precision-keeping) casts stripped: x for x.float().to(torch.float64)."""
    while _is_exact_cast(node):
        node = node.args[0]
    return node


def _walk_upcasts(x: torch.fx.Node, pattern: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """Casts above x that only the pattern reads and that do not lose precision, innermost first."""
    casts = []
    while _is_exact_cast(x) and all(u in pattern for u in x.users):
        casts.append(x)
        pattern = pattern | {x}
        x = x.args[0]
    return casts


def _match_norm_call(node: torch.fx.Node) -> _Core:
    is_rms = is_op(node, "rms_norm")
    variant = "F.rms_norm" if is_rms else "F.layer_norm"
    inp = arg(node, 0, "input")
    t = tensor_meta(inp)
    if t is None:
        raise _Miss("the input has no shape/dtype metadata")
    shape = val(arg(node, 1, "normalized_shape"))
    shape = [val(s) for s in shape] if isinstance(shape, (list, tuple, torch.Size)) else [shape]
    if len(shape) != 1:
        raise _Miss(f"normalises over the last {len(shape)} dims; the fused op normalises the last dim only")
    weight = arg(node, 2, "weight")
    bias = None if is_rms else arg(node, 3, "bias")
    eps = arg(node, 3 if is_rms else 4, "eps", None if is_rms else 1e-5)
    if eps is None and is_rms:
        eps = _opmath_eps(t.dtype)
    eps = _constant(eps, "eps")
    upcasts = _walk_upcasts(inp, {node})
    x = upcasts[-1].args[0] if upcasts else inp
    return _Core(variant, is_rms, x, upcasts, eps, weight, bias, node, node)


def _denominator(stat: torch.fx.Node):
    """From a variance / mean square: (eps, intermediate nodes, root, is_sqrt) for ``rsqrt(stat + eps)`` /
    ``sqrt(stat + eps)`` / ``(stat + eps) ** ±0.5`` / ``1 / sqrt(..)`` (eps may be absent), else None."""
    base, nodes, eps = stat, set(), 0.0
    for user in stat.users:
        other = binary_other(user, "add", stat)
        if other is not None and _is_scalar(other):
            base, nodes, eps = user, {user}, other
            break
    for user in base.users:
        if user.args and user.args[0] is base and not user.kwargs:
            if is_op(user, "rsqrt") and len(user.args) == 1:
                return eps, nodes, user, False
            if is_op(user, "sqrt") and len(user.args) == 1:
                return (eps, *_reciprocal_of(user, nodes))
            if is_op(user, "pow") and len(user.args) == 2 and user.args[1] in (0.5, -0.5):
                if user.args[1] == 0.5:
                    return (eps, *_reciprocal_of(user, nodes))
                return eps, nodes, user, False
    return None


def _reciprocal_of(root: torch.fx.Node, nodes: set) -> tuple[set, torch.fx.Node, bool]:
    """(nodes, root, is_sqrt) for a square root, seen as an rsqrt when it is only inverted
    (``1 / sqrt(..)``, ``torch.reciprocal(sqrt(..))``), which then multiplies the value."""
    if len(root.users) == 1:
        user = next(iter(root.users))
        pair = binary_operands(user, "div")
        if pair is not None and pair[1] is root and is_number(pair[0]) and pair[0] == 1 or (
            is_op(user, "reciprocal") and user.args == (root,) and not user.kwargs
        ):
            return nodes | {root}, user, False
    return nodes, root, True


def _given_back(node: torch.fx.Node) -> torch.fx.Node | None:
    """The single user of node that appends a last dim of size 1 (``.unsqueeze(-1)``, ``[..., None]``):
    on a per-row statistic reduced without keepdim, that gives the reduced dim back, the same values as
    keepdim=True. None otherwise."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    if _unsqueeze_pos(user, node) is not None:
        pos = _unsqueeze_pos(user, node)
    elif _appends_none(user) and user.args[0] is node:
        pos = -1
    else:
        return None
    t = tensor_meta(user)
    if t is None or not isinstance(pos, int) or not -t.dim() <= pos < t.dim() or pos % t.dim() != t.dim() - 1:
        return None
    return user


def _chain_given_back(chain):
    """(chain, given back) for a statistic reduced without keepdim: the chain's root followed by the dim given
    back (``rsqrt(x.pow(2).mean(-1) + eps)[..., None]``) ends at that node instead."""
    if chain is None:
        return None, False
    eps, nodes, root, is_sqrt = chain
    back = _given_back(root)
    if back is None:
        return chain, False
    return (eps, nodes | {root}, back, is_sqrt), True


@dataclass
class _Scaled:
    """value * rsqrt(..) / value / sqrt(..): the node, the accepted value, and a weight the value was
    multiplied by first (``w * (x - mean) / sqrt(var + eps)``, parsed as ``(w * (x - mean)) / ...``)."""

    out: torch.fx.Node
    value: torch.fx.Node
    weight: torch.fx.Node | None = None
    weighted: torch.fx.Node | None = None


def _numerator(root: torch.fx.Node, is_sqrt: bool, accept, n, source: torch.fx.Node) -> _Scaled:
    """The node computing value * rsqrt(..) or value / sqrt(..), with value accepted (or value * weight,
    either order, weight a row of n (_is_row: (n,), (1, n), ..) and not computed from the normalised tensor
    source)."""
    for user in root.users:
        if is_sqrt:
            pair = binary_operands(user, "div")
            candidate = pair[0] if pair is not None and pair[1] is root else None
        else:
            candidate = binary_other(user, "mul", root)
        if not isinstance(candidate, torch.fx.Node):
            continue
        if accept(candidate):
            return _Scaled(user, candidate)
        pair = binary_operands(candidate, "mul")
        for value, weight in (pair, pair[::-1]) if pair is not None else ():
            if accept(value) and _is_row(tensor_meta(weight), n, _rank(value)) \
                    and not _depends_on(weight, {source}):
                _check_product_kept(candidate, user)
                return _Scaled(user, value, weight, candidate)
    for user in root.users:
        if binary_other(user, "add", root) is not None and _is_scalar(binary_other(user, "add", root)):
            raise _Miss(f"eps is added after the square root ({root.name} + eps), not under it as "
                        "LayerNorm / RMSNorm add it: not the same function")
    form = "value / sqrt(...)" if is_sqrt else "value * rsqrt(...)"
    raise _Miss(f"{root.name} does not scale the normalised value as {form}")


def _check_product_kept(weighted: torch.fx.Node, out: torch.fx.Node) -> None:
    """``(w * x) * rsqrt(..)`` with w and x in bf16 and the statistic upcast: eager rounds the product to bf16
    and widens it to the fp32 result, which then has bf16 precision; the op multiplies by the weight in fp32
    and rounds once. Not the same function (as a rounding cast in the tail, see _check_rounding_kept)."""
    a, b = tensor_meta(weighted), tensor_meta(out)
    if a is not None and b is not None and torch.promote_types(a.dtype, b.dtype) != a.dtype:
        raise _Miss(f"the value times the weight ({weighted.name}) is rounded to {a.dtype} and widened to "
                    f"{b.dtype} by the scaling: the fused op, multiplying in float32, would not round it")


# --------------------------------------------------------------------------------------------------------
# Means, however spelled
# --------------------------------------------------------------------------------------------------------


@dataclass
class _Mean:
    """A mean of src over dim, in any of the spellings _as_mean knows. keepdim is whether node, the value
    the norm reads, keeps the reduced dim (given back by an unsqueeze counts); nodes compute it from src."""

    node: torch.fx.Node
    src: torch.fx.Node
    dim: object
    keepdim: bool
    has_dtype: bool
    nodes: frozenset[torch.fx.Node]
    # why the divisor of a sum cannot be proven to be the reduced size (a literal N over a symbolic size):
    # raised as the near miss once the rest of the pattern matches
    doubt: str | None = None


def _reduction(node: object, name: str) -> _Mean | None:
    """``name(src, dim, keepdim)`` for name "mean" or "sum", as a _Mean (a sum is not one yet)."""
    if not isinstance(node, torch.fx.Node) or not is_op(node, name) or not node.args:
        return None
    src = node.args[0]
    if not isinstance(src, torch.fx.Node):
        return None
    return _Mean(node, src, *_mean_spec(node), frozenset({node}))


def _reduced_dims(m: _Mean) -> list[int] | None:
    """The dims m reduces, non-negative; None when they are not plain ints (or all dims)."""
    t = tensor_meta(m.src)
    dims = m.dim if isinstance(m.dim, (list, tuple)) else [m.dim]
    if t is None or not dims or not all(isinstance(d, int) and -t.dim() <= d < t.dim() for d in dims):
        return None
    return [d % t.dim() for d in dims]


def _appends_none(node: torch.fx.Node) -> bool:
    """node is ``t[..., None]`` or ``t[:, ..., :, None]`` (every dim of t taken whole): a new last dim of
    size 1."""
    if not is_op(node, "getitem") or len(node.args) != 2 or not isinstance(node.args[1], tuple):
        return False
    t, index = tensor_meta(node.args[0]), node.args[1]
    if index == (Ellipsis, None):
        return True
    whole = slice(None, None, None)
    return t is not None and len(index) == t.dim() + 1 and index[-1] is None and all(
        i == whole for i in index[:-1])


def _keepdim_restored(node: torch.fx.Node, match) -> _Mean | None:
    """match(node); or, for node = r.unsqueeze(d) / r[..., None], the reduction r = match(r) taken without
    keepdim and given its one reduced dim d back, which is the same as keepdim=True."""
    if _unsqueeze_pos(node) is not None:
        inner, pos = node.args[0], _unsqueeze_pos(node)
    elif _appends_none(node):
        inner, pos = node.args[0], -1
    else:
        return match(node)
    r = match(inner)
    t = tensor_meta(node)
    if r is None or r.keepdim or t is None or not isinstance(pos, int) or not -t.dim() <= pos < t.dim():
        return None
    if _reduced_dims(r) != [pos % t.dim()]:
        return None
    return _Mean(node, r.src, r.dim, True, r.has_dtype, r.nodes | {node}, r.doubt)


def _count_doubt(divisor: object, count, reciprocal: bool) -> tuple[bool, str | None]:
    """(could be, doubt) for a sum divided by divisor (multiplied by it when reciprocal) being a mean over
    count elements. A number equal to the count, or a size that is the count: (True, None). A number that
    a symbolic count (dynamic shapes) is only for this example: (True, why that is not proven)."""
    v = val(divisor) if isinstance(divisor, torch.fx.Node) else divisor
    if isinstance(v, bool) or not isinstance(v, (int, float, torch.SymInt)):
        return False, None  # a tensor, a SymFloat, anything else: not a count
    if reciprocal:  # 1 / N up to the rounding of the division (a few ulps of a double)
        if not is_number(v) or not 0 < v <= 1 or abs(v * round(1 / v) - 1) > 4 * sys.float_info.epsilon:
            return False, None
        v = round(1 / v)
    if _same_size(v, count):
        return True, None
    hint = count.node.hint if isinstance(count, torch.SymInt) and is_number(v) else None
    if hint is None or hint != v:
        return False, None
    return True, (f"the sum is divided by {getattr(divisor, 'name', divisor)!r}, the reduced size only for "
                  f"this example: the size is symbolic ({count}, dynamic shapes)")


def _sum_over_count(node: torch.fx.Node) -> _Mean | None:
    """``s / N``, ``s * (1 / N)`` or ``(1 / N) * s`` where s sums over dims of N elements in all (N a
    number or the size itself, ``x.shape[-1]``): a mean. Any other divisor (N - 1, another dim's size)
    is another function, not a candidate; a float16 sum, which overflows where the mean does not, a doubt."""
    pair = binary_operands(node, "div")
    options = [(pair[0], pair[1], False)] if pair is not None else []
    pair = binary_operands(node, "mul")
    options += [(a, b, True) for a, b in ((pair, pair[::-1]) if pair is not None else ())]
    for summed, divisor, reciprocal in options:
        s = _keepdim_restored(summed, lambda n: _reduction(n, "sum"))
        dims = _reduced_dims(s) if s is not None else None
        if dims is None:
            continue
        count = math.prod(tensor_meta(s.src).shape[d] for d in dims)
        fits, doubt = _count_doubt(divisor, count, reciprocal)
        t = tensor_meta(summed)
        if fits and doubt is None and t is not None and t.dtype == torch.float16:
            doubt = ("the sum is rounded to float16, which overflows past 65504 where the mean does not "
                     "(ATen's mean accumulates in float32): not the same function")
        if fits:
            return _Mean(node, s.src, s.dim, s.keepdim, s.has_dtype, s.nodes | {node}, doubt)
    return None


def _as_mean(node: object) -> _Mean | None:
    """A mean, however spelled: ``mean(x, dim, keepdim)`` (method or function, dim an int or a 1-list),
    ``sum(x, dim, keepdim) / N`` (or ``* (1 / N)``), and either reduced without keepdim and unsqueezed
    back (``x.mean(-1).unsqueeze(-1)``, ``x.mean(-1)[..., None]``). None for anything else."""
    if not isinstance(node, torch.fx.Node):
        return None
    return _keepdim_restored(node, lambda n: _reduction(n, "mean") or _sum_over_count(n))


def _means_of(t: torch.fx.Node) -> list[_Mean]:
    """The means of t that its users compute (every spelling _as_mean knows), in graph order."""
    found, frontier = [], [u for u in t.users if is_op(u, "mean", "sum") and u.args and u.args[0] is t]
    seen = set()
    for _ in range(3):  # a reduction, then at most a divide and an unsqueeze
        following = []
        for n in frontier:
            if n in seen:
                continue
            seen.add(n)
            m = _as_mean(n)
            if m is not None and m.src is t:
                found.append(m)
            following += [u for u in n.users if is_op(u, "div", "mul", "unsqueeze", "getitem")]
        frontier = following
    order = {n: i for i, n in enumerate(t.graph.nodes)}
    return sorted(found, key=lambda m: order[m.node])


def _check_mean(m: _Mean, what: str) -> None:
    """A mean the fused op computes: over the last dim only, keepdim, no dtype=, a proven divisor."""
    _check_last_dim(m.src, m.dim, m.keepdim, what)
    if m.has_dtype:
        raise _Miss(f"{what} has a dtype= argument")
    if m.doubt is not None:
        raise _Miss(f"{what}: {m.doubt}")


def _centered(node: object, mean: _Mean) -> bool:
    """node is X - mean(X)."""
    pair = binary_operands(node, "sub") if isinstance(node, torch.fx.Node) else None
    return pair is not None and pair[1] is mean.node and _same_value(pair[0], mean.src)


def _match_rms(mean: _Mean) -> _Core | None:
    y = _square_of(mean.src)
    if y is None:
        return None
    if isinstance(y, torch.fx.Node) and binary_operands(y, "sub"):
        centre = _as_mean(y.args[1])
        if centre is not None and _centered(y, centre):
            return None  # the variance of a hand-written LayerNorm: matched from its mean
    chain = _denominator(mean.node)
    if not mean.keepdim:  # the reduced dim given back after the eps and the root
        chain, back = _chain_given_back(chain)
        mean = replace(mean, keepdim=back)
    if chain is None:
        return None
    variant = "hand-written RMSNorm"
    _check_mean(mean, "the mean of squares")
    _check_not_float16(mean.src, f"the square {mean.src.name}")
    eps, nodes, root, is_sqrt = chain
    n = tensor_meta(mean.src).shape[-1]
    # T5 squares x.float() but scales x itself: the same values, as upcasts are exact.
    accept = lambda v: _same_value(v, y) or _upcast_root(v) is _upcast_root(y)
    scaled = _numerator(root, is_sqrt, accept, n, _upcast_root(y))
    out, value = scaled.out, scaled.value
    eps = _constant(eps, "eps")
    inner = {mean.src, root} | mean.nodes | nodes
    if scaled.weighted is not None:
        inner.add(scaled.weighted)
    if value is not y and value is not _upcast_root(y):
        inner.add(value)  # a second spelling of y's cast
    upcasts = _walk_upcasts(y, inner | {out})
    x = upcasts[-1].args[0] if upcasts else y
    if scaled.weight is not None:
        variant += " + weight"  # on the numerator: (w * x) * rsqrt(...)
    return _Core(variant, True, x, upcasts, eps, scaled.weight, None, out, mean.node, inner)


def _biased(node: torch.fx.Node) -> bool:
    """A var / std / var_mean / std_mean call with unbiased=False or correction=0 (LayerNorm's variance)."""
    unbiased, correction = arg(node, 2, "unbiased", None), node.kwargs.get("correction")
    if isinstance(unbiased, bool) and correction is None:
        return not unbiased
    return unbiased is None and correction is not None and correction == 0


_REDUCTION_NAMES = {"var": "the variance", "std": "the standard deviation", "var_mean": "var_mean",
                    "std_mean": "std_mean"}


def _match_layer(mean: _Mean) -> _Core | None:
    x = mean.src
    subs = [u for u in mean.node.users if _centered(u, mean)]
    if not subs:
        return None
    # The variance: x.var(dim, unbiased=False / correction=0) or a mean of (x - mean)**2 (any spelling
    # _as_mean knows); or the standard deviation x.std(dim, ...), which is already its square root.
    stats: list[torch.fx.Node | _Mean] = []
    for node in list(x.users) + [v for s in subs for v in s.users]:
        if is_op(node, "var", "std") and node.args and node.args[0] is x:
            stats.append(node)
        elif _square_of(node) is not None and any(_same_value(_square_of(node), s) for s in subs):
            stats.extend(_means_of(node))
    stats = list({id(s): s for s in stats}.values())
    chains = [(s, *_variance_chain(s)) for s in stats]
    chains = [(s, c, back) for s, c, back in chains if c is not None]
    if not chains:
        return None
    stat, chain, back = chains[0]
    _check_mean(mean, "the mean")
    if isinstance(stat, _Mean):
        reduction = None
        _check_mean(replace(stat, keepdim=stat.keepdim or back is not None), "the variance")
        _check_not_float16(stat.src, f"the squared centred value {stat.src.name}")
        inner = {stat.src, *stat.nodes} | {a for a in stat.src.args if isinstance(a, torch.fx.Node)}
    else:
        reduction, inner = stat, {stat}
    if back is not None:
        inner.add(back)
    return _layer_core(x, subs, reduction, chain, inner | mean.nodes, mean.node, given_back=back is not None)


def _variance_chain(stat: torch.fx.Node | _Mean):
    """(chain, the node giving the reduced dim back or None) of a variance / standard deviation: _stat_chain,
    where a statistic reduced without keepdim may get its dim back on itself (``x.var(-1, ..)[..., None]``)
    or after its root (``rsqrt(x.var(-1, ..) + eps)[..., None]``)."""
    is_std = not isinstance(stat, _Mean) and is_op(stat, "std")  # a _Mean is no std
    keepdim = stat.keepdim if isinstance(stat, _Mean) else bool(_kwarg(stat, 3, "keepdim", False))
    if keepdim:
        return _stat_chain(stat, is_std), None
    node = stat.node if isinstance(stat, _Mean) else stat
    back = _given_back(node)
    if back is not None:
        return _stat_chain(back, is_std), back
    chain, given = _chain_given_back(_stat_chain(stat, is_std))
    return chain, (chain[2] if given else None)


def _match_var_mean(vm: torch.fx.Node) -> _Core | None:
    """``var, mean = torch.var_mean(x, -1, keepdim=True, unbiased=False)`` (or std_mean) and
    ``(x - mean) * rsqrt(var + eps)`` / ``(x - mean) / (std + ...)``."""
    items = {u.args[1]: u for u in vm.users if is_op(u, "getitem") and len(u.args) == 2}
    if set(items) != {0, 1} or len(vm.users) != 2 or not vm.args:
        return None
    stat, mean, x = items[0], items[1], vm.args[0]
    inner = {vm, stat, mean}
    # Reduced without keepdim, both statistics may get the dim back (``mean[..., None]``, ``var[..., None]``
    # or ``rsqrt(var + eps)[..., None]``): the same values as keepdim=True. Only one of them given back
    # broadcasts differently, which _layer_core reports.
    mean_back = None if _kwarg(vm, 3, "keepdim", False) else _given_back(mean)
    if mean_back is not None:
        inner.add(mean_back)
        mean = mean_back
    subs = [u for u in mean.users
            if binary_operands(u, "sub") and u.args[1] is mean and _same_value(u.args[0], x)]
    if not subs:
        return None
    is_std = is_op(vm, "std_mean")
    stat_back = None if mean_back is None else _given_back(stat)
    if stat_back is not None:
        inner.add(stat_back)
        chain = _stat_chain(stat_back, is_std)
    else:
        chain, given = _chain_given_back(_stat_chain(stat, is_std)) if mean_back is not None else (
            _stat_chain(stat, is_std), False)
        stat_back = chain[2] if given else None
    if chain is None:
        return None
    return _layer_core(x, subs, vm, chain, inner, vm, given_back=stat_back is not None)


def _stat_chain(stat: torch.fx.Node | _Mean, is_std: bool):
    """_denominator of a variance; a standard deviation is its own square root (eps absent)."""
    if isinstance(stat, _Mean):
        stat = stat.node
    return (0.0, set(), stat, True) if is_std else _denominator(stat)


def _layer_core(x, subs, reduction, chain, inner: set, anchor, given_back: bool = False) -> _Core:
    """The LayerNorm core from its centred values and statistic. reduction is the var / std / var_mean /
    std_mean call whose dim, keepdim and correction are checked here (None: a mean of squares, checked
    by the caller); given_back: its reduced dim is given back by an unsqueeze, which counts as keepdim."""
    eps, nodes, root, is_sqrt = chain
    reasons = []
    if reduction is not None:
        what = _REDUCTION_NAMES[op_name(reduction)]
        dim, keepdim = _kwarg(reduction, 1, "dim"), bool(_kwarg(reduction, 3, "keepdim", False))
        _check_last_dim(reduction.args[0], dim, keepdim or given_back, what)
        if not _biased(reduction):
            reasons.append(f"{what} is unbiased (needs unbiased=False or correction=0, as LayerNorm uses)")
        # var's result has its input's dtype; a std is left as it is (see _float16_reason)
        float16 = _float16_reason(reduction.args[0], what) if op_name(reduction) != "std" and \
            op_name(reduction) != "std_mean" else None
        if float16 is not None:
            reasons.append(float16)
    # Every reason is given (the Annotated Transformer's x.std() + eps has two).
    try:
        scaled = _numerator(root, is_sqrt, lambda v: any(_same_value(v, s) for s in subs),
                            tensor_meta(x).shape[-1], _upcast_root(x))
    except _Miss as miss:
        raise _Miss("; ".join(reasons + [str(miss)])) from None
    if reasons:
        raise _Miss("; ".join(reasons))
    eps = _constant(eps, "eps")
    inner = inner | {root, scaled.value} | set(subs) | nodes
    if scaled.weighted is not None:
        inner.add(scaled.weighted)
    inner.discard(x)
    upcasts = _walk_upcasts(x, inner | {scaled.out})
    x_in = upcasts[-1].args[0] if upcasts else x
    # A weight on the numerator ((w * (x - mean)) / sqrt(var + eps)) is the op's weight, named in the variant.
    variant = "hand-written LayerNorm" + (" + weight" if scaled.weight is not None else "")
    return _Core(variant, False, x_in, upcasts, eps, scaled.weight, None, scaled.out, anchor, inner)


def _two_norm(node: torch.fx.Node):
    """(x, dim, keepdim) of the Euclidean norm of x over dim (x.norm(2, dim), torch.norm,
    torch.linalg.vector_norm / norm), else None."""
    if (node.op, node.target) in (("call_method", "norm"), ("call_function", torch.norm)):
        p = arg(node, 1, "p", "fro")
    elif node.op == "call_function" and node.target in (torch.linalg.vector_norm, torch.linalg.norm):
        p = arg(node, 1, "ord", None)
    else:
        return None
    dim, keepdim = _kwarg(node, 2, "dim"), _kwarg(node, 3, "keepdim", False)
    # "fro" and ord=None over one dim are the 2-norm too
    if p not in (2, "fro", None) or dim is None or "dtype" in node.kwargs or not node.args:
        return None
    return node.args[0], dim, bool(keepdim)


def _divides(node: torch.fx.Node, by: torch.fx.Node, x) -> bool:
    """node is x / by (x or an exact upcast of it)."""
    pair = binary_operands(node, "div")
    if pair is None or pair[1] is not by:
        return False
    return _same_value(pair[0], x) or _upcast_root(pair[0]) is _upcast_root(x)


def _match_two_norm_rms(norm: torch.fx.Node) -> _Core | None:
    """RMSNorm from the 2-norm: ``x / (x.norm(2, -1, keepdim=True) * N ** -0.5)`` (or ``/ sqrt(N)``), which
    is ``x * rsqrt(mean(x²))``, eps = 0. Adding eps to that root mean square, or clamping it, is another
    function (Zhang & Sennrich's reference RMSNorm, lucidrains'): reported, not rewritten."""
    spec = _two_norm(norm)
    if spec is None:
        return None
    x, dim, keepdim = spec
    t = tensor_meta(x)
    if t is None or len(norm.users) != 1 or norm_dim(dim, t.dim()) is None:
        return None
    n = t.shape[norm_dim(dim, t.dim())]
    rms = next(iter(norm.users))
    c, inverse = binary_other(rms, "mul", norm), False
    if c is None:
        pair = binary_operands(rms, "div")
        c, inverse = (pair[1], True) if pair is not None and pair[0] is norm else (None, False)
    if c is None or not _is_scalar(c) or is_number(c) and c == 0:
        return None
    if not (is_number(c) and isinstance(n, int)):
        if any(_divides(u, rms, x) for u in rms.users):
            raise _Miss(f"the 2-norm's scale {getattr(c, 'name', c)} or the size {n} is symbolic (dynamic "
                        "shapes): it cannot be proven to be 1 / sqrt(N)")
        return None
    # c > 0: the test on c * c alone took ``x / (norm * -N ** -0.5)``, the RMSNorm with its sign flipped
    if c <= 0 or abs((n / (c * c) if inverse else c * c * n) - 1) > 1e-6:
        return None  # a norm, but not scaled to a root mean square (F.normalize-like): not a candidate
    variant = "hand-written RMSNorm (2-norm / sqrt(N))"
    for user in rms.users:
        eps = binary_other(user, "add", rms)
        if eps is not None and _is_scalar(eps) and any(_divides(u, user, x) for u in user.users):
            raise _Miss("eps is added to the root mean square (x / (norm / sqrt(N) + eps)), not under the "
                        "square root as RMSNorm does (x * rsqrt(mean(x²) + eps)): not the same function")
        if is_op(user, "clamp", "clamp_min") and any(_divides(u, user, x) for u in user.users):
            raise _Miss("the root mean square is clamped (x / max(norm / sqrt(N), eps)), not eps added under "
                        "the square root as RMSNorm does (x * rsqrt(mean(x²) + eps)): not the same function")
    out = next((u for u in rms.users if _divides(u, rms, x)), None)
    if out is None:
        return None
    _check_last_dim(x, dim, keepdim, "the 2-norm")
    _check_not_float16(norm, f"the 2-norm {norm.name}")
    inner = {norm, rms}
    if out.args[0] is not x and out.args[0] is not _upcast_root(x):
        inner.add(out.args[0])
    upcasts = _walk_upcasts(x, inner | {out})
    x_in = upcasts[-1].args[0] if upcasts else x
    return _Core(variant, True, x_in, upcasts, 0.0, None, None, out, norm, inner)


def _check_inner(core: _Core) -> None:
    pattern = core.inner | {core.out} | set(core.upcasts)
    for node in sorted(core.inner | set(core.upcasts), key=lambda n: n.name):
        outside = [u for u in node.users if u not in pattern]
        if outside:
            raise _Miss(f"intermediate {node.name} ({op_name(node)}) has users outside the norm: "
                        + ", ".join(u.name for u in outside))


def _widen_tail(core: _Core) -> None:
    """Fold the trailing casts, * weight and (LayerNorm) + bias that only the norm's result feeds."""
    n = tensor_meta(core.x).shape[-1]
    cur = core.out
    pattern = core.inner | {core.out} | set(core.upcasts) | {core.x}
    has_weight, has_bias = core.weight is not None, core.bias is not None
    while len(cur.users) == 1:
        user = next(iter(cur.users))
        if _is_cast(user) and user.args[0] is cur:
            core.tail.append(("cast", user, None))
            cur = user
            continue
        if not has_weight and not has_bias and not core.is_rms:
            affine = _addcmul_affine(user, cur, n, pattern)
            if affine is not None:
                has_weight = has_bias = True
                core.tail.append(("weight + bias", user, affine))
                cur = user
                continue
        is_mul = not has_weight and not has_bias and binary_other(user, "mul", cur) is not None
        is_add = not core.is_rms and not has_bias and binary_other(user, "add", cur) is not None
        if not (is_mul or is_add):
            break
        operand = binary_other(user, "mul" if is_mul else "add", cur)
        t = tensor_meta(operand)
        if t is None or operand is cur:
            break
        what = "weight" if is_mul else "bias"
        rank = _rank(cur)
        if _is_row(t, n, rank):
            if _depends_on(operand, pattern):
                break
            has_weight, has_bias = has_weight or is_mul, has_bias or is_add
            core.tail.append((what, user, operand))
            cur = user
            continue
        if _is_row(t, n, t.dim()):  # a row with more dims than the normalised value
            raise _Miss(f"{what} {operand.name} has shape {tuple(t.shape)}, not ({n},), and more dims than "
                        f"the normalised value ({rank}): its broadcast adds dims to eager's output, which "
                        "the fused op's does not have")
        break


def _addcmul_affine(node: torch.fx.Node, cur: torch.fx.Node, n, pattern) -> tuple | None:
    """(weight, bias) of ``torch.addcmul(bias, cur, weight)`` (either factor order, value=1), both rows of n
    (_is_row) the norm does not compute, else None."""
    if not is_op(node, "addcmul") or len(node.args) != 3 or set(node.kwargs) - {"value"}:
        return None
    if node.kwargs.get("value", 1) != 1:
        return None
    bias, t1, t2 = node.args
    if cur not in (t1, t2) or t1 is t2 or bias is cur:
        return None
    weight = t2 if t1 is cur else t1
    for operand in (weight, bias):
        if not _is_row(tensor_meta(operand), n, _rank(cur)) or _depends_on(operand, pattern):
            return None
    return weight, bias


def _affine(core: _Core, tail) -> tuple[torch.fx.Node | None, torch.fx.Node | None]:
    weight, bias = core.weight, core.bias
    for kind, _, operand in tail:
        if kind == "weight":
            weight = operand
        elif kind == "bias":
            bias = operand
        elif kind == "weight + bias":  # addcmul(bias, normalised, weight)
            weight, bias = operand
    return weight, bias


# --------------------------------------------------------------------------------------------------------
# Dropout and residual
# --------------------------------------------------------------------------------------------------------


@dataclass
class _Inputs:
    x: torch.fx.Node
    residual: torch.fx.Node | None
    dropout_p: float
    folded: list[torch.fx.Node]  # the add / dropout nodes replaced by the op
    h: torch.fx.Node | None  # the pre-norm sum, when folded
    # The dims permutation of the views between the folded sum and the norm (_through_row_views), applied to
    # the op's output; None when the norm reads the sum itself.
    rows_perm: list[int] | None = None


def _dropout_input(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor a dropout call drops, by position or by keyword: ``F.dropout(input=x, p=..)`` has no
    positional argument, and reading ``node.args[0]`` failed the match with an IndexError (review s26)."""
    x = arg(node, 0, "input")
    if not isinstance(x, torch.fx.Node):
        raise _Miss(f"dropout {node.name} has no tensor input node")
    return x


def _dropout_p(node: torch.fx.Node) -> float:
    """The dropout probability node applies (0.0 when not training), or _Miss."""
    if node.target is torch.dropout:
        p, training, inplace = arg(node, 1, "p"), arg(node, 2, "train"), False
    else:
        p, training = arg(node, 1, "p", 0.5), arg(node, 2, "training", True)
        inplace = arg(node, 3, "inplace", False)
    if not isinstance(training, bool):
        raise _Miss(f"dropout's training flag is not a constant ({training!r})")
    if not training:
        if isinstance(p, torch.fx.Node):
            # With dynamic=True, p is a float input that the folded dropout was the only reader of; Inductor
            # would specialise it, restarting dynamo after this run was counted. Specialise it here instead.
            try:
                _constant(p, "dropout p")
            except _Miss:
                pass  # data-dependent: nothing to specialise, and eval dropout ignores p anyway
        return 0.0
    p = _constant(p, "dropout p")
    if not 0.0 <= p < 1.0:
        raise _Miss(f"dropout p={p} is outside [0, 1)")
    if inplace and p > 0.0:
        src = _dropout_input(node)
        t = tensor_meta(src)
        if len(src.users) > 1:
            raise _Miss(f"inplace dropout whose input {src.name} has other users "
                        "(they would see the dropped values)")
        if src.op in ("placeholder", "get_attr") or t is None or t._is_view():
            raise _Miss(f"inplace dropout mutates {src.name}, a graph input or a view")
        sharer = _memory_sharer(src, {node})
        if sharer is not None:
            raise _Miss(f"inplace dropout writes into {src.name}, whose memory {sharer.name} shares (an "
                        "alias: a cast or .contiguous() that returned its input, .detach(), a view): its "
                        "readers would see the dropped values, which the fused op does not write")
    return p


def _memory_sharer(node: torch.fx.Node, exclude: set[torch.fx.Node]) -> torch.fx.Node | None:
    """Another node of the graph whose tensor shares node's memory, by the storages of dynamo's fake values
    (which keep eager's aliasing: ``a.float()`` of an fp32 a, ``a.contiguous()``, ``a.to(a.dtype)`` return a
    itself, ``a.detach()`` and views share its storage); node itself when that cannot be told (review s29:
    ``F.dropout(a.float(), p, inplace=True)`` drops a's values in place, which a's other readers see)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        ref = StorageWeakRef(tensor_meta(node).untyped_storage())
        for other in node.graph.nodes:
            t = tensor_meta(other)
            if other is not node and other not in exclude and t is not None and \
                    StorageWeakRef(t.untyped_storage()) == ref:
                return other
    except Exception:  # noqa: BLE001 - a value whose storage cannot be read: assume it is shared
        return node
    return None


_TRANSPOSE_DIMS = {"transpose": ("dim0", "dim1"), "swapdims": ("dim0", "dim1"),
                   "swapaxes": ("axis0", "axis1")}


def _row_permutation(node: torch.fx.Node) -> tuple[torch.fx.Node, list[int]] | None:
    """(source, perm) when node is ``source.permute(perm)`` with the last dim kept last, spelled as a
    transpose of two other dims, a permute, or ``contiguous()`` (the identity); otherwise None."""
    src, t = arg(node, 0, "input"), tensor_meta(node)
    if not isinstance(src, torch.fx.Node) or t is None or tensor_meta(src) is None:
        return None
    rank = t.dim()
    if is_op(node, "contiguous") and len(node.args) == 1 and not node.kwargs:
        return src, list(range(rank))
    name = op_name(node)
    if name in _TRANSPOSE_DIMS:
        d0, d1 = (norm_dim(arg(node, i + 1, key), rank) for i, key in enumerate(_TRANSPOSE_DIMS[name]))
        if d0 is None or d1 is None or rank - 1 in (d0, d1):
            return None
        perm = list(range(rank))
        perm[d0], perm[d1] = d1, d0
        return src, perm
    if name == "permute":
        dims = node.args[1:] if len(node.args) > 1 else (node.kwargs.get("dims"),)
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        perm = [norm_dim(d, rank) for d in dims]
        if len(perm) != rank or sorted(p for p in perm if p is not None) != list(range(rank)) \
                or perm[-1] != rank - 1:
            return None
        return src, perm
    return None


def _through_row_views(h: torch.fx.Node) -> list[_Inputs]:
    """The ways to fold a dropout / residual add that reaches h through views that only move rows whole.

    OpenFold's column attention normalises ``m.transpose(-2, -3)`` of the residual sum ``m = m + row(m)`` (its
    triangle attention around the ending node likewise): the norm is over the last dim, which such a view
    keeps, so ``norm(perm(a + b)) = perm(norm(a + b))`` row for row. The op then takes a and b in their own
    layout and its output is permuted as eager's input was; the sum's other readers get the op's residual
    output, unpermuted. Each view must be read by the next step alone (checked in _plan)."""
    views, perm, base = [], None, h
    while (found := _row_permutation(base)) is not None:
        views.append(base)
        base, p = found
        perm = p if perm is None else [p[i] for i in perm]  # base.permute(p).permute(perm)
    if not views:
        return []
    try:
        options = _input_options(base)
    except _Miss:
        return []
    return [replace(o, folded=o.folded + views, rows_perm=perm) for o in options if o.folded]


def _layout_of_norm_output(want) -> bool:
    """Whether eager's result (its metadata want) is contiguous where the op's, permuted back (rows_perm),
    would not be: F.layer_norm / F.rms_norm return a contiguous tensor whatever their input's layout, a
    norm written out keeps its input's strides (elementwise ops), so the permuted output is made contiguous
    when eager's is (a later ``.view`` of it would fail otherwise)."""
    return want is not None and want.is_contiguous()


def _rows_back(out: torch.Tensor, rows_perm: list[int], want) -> torch.Tensor:
    """The op's (fake) output permuted as the norm's input was, in eager's layout (_layout_of_norm_output)."""
    out = out.permute(rows_perm)
    return out.contiguous() if _layout_of_norm_output(want) else out


def _input_options(h: torch.fx.Node) -> list[_Inputs]:
    """How the normalised tensor h can feed the op, most fused first."""
    through = _through_row_views(h)
    if through:
        return through + [_Inputs(h, None, 0.0, [], None)]
    t = tensor_meta(h)
    if is_op(h, "dropout"):
        return [_Inputs(_dropout_input(h), None, _dropout_p(h), [h], h)]
    pair = binary_operands(h, "add")
    if pair is None or not all(isinstance(a, torch.fx.Node) for a in pair):
        return [_Inputs(h, None, 0.0, [], None)]
    metas = [tensor_meta(a) for a in pair]
    if any(m is None or not _same_shape(m, t) for m in metas):
        return [_Inputs(h, None, 0.0, [], None)]
    a, b = pair
    drops = [(d, r) for d, r in ((a, b), (b, a)) if is_op(d, "dropout") and d is not r]
    # A dropout whose output is read elsewhere too (DistilBERT's first layer: the embeddings' dropout feeds
    # q/k/v and the residual add) cannot be folded, its mask would be drawn twice; it then stays where it
    # is and its output is the add's plain residual operand.
    foldable = [(d, r) for d, r in drops if len(d.users) == 1]
    if foldable:
        d, r = foldable[0]
        p = _dropout_p(d)
        return [_Inputs(_dropout_input(d), r, p, [h, d], h)]
    return [_Inputs(a, b, 0.0, [h], h), _Inputs(b, a, 0.0, [h], h)]


# --------------------------------------------------------------------------------------------------------
# Rewrite
# --------------------------------------------------------------------------------------------------------


def _fused_op():
    return fused_op(_OP_MODULE, "add_dropout_norm")


def _describe(core: _Core, inputs: _Inputs, return_residual: bool) -> str:
    parts = []
    if any(is_op(n, "dropout") for n in inputs.folded):
        parts.append("dropout")
    if inputs.residual is not None:
        parts.append("residual add")
    if inputs.rows_perm is not None:
        parts[-1] += " (rows permuted)"
    parts.append(core.variant)
    affine = [k for k, _, _ in core.tail if k != "cast"]
    if affine:
        parts.append(" + ".join(affine))
    return " + ".join(parts) + (" (pre-norm, returns the residual)" if return_residual else "")


def _plan(fn, core: _Core, inputs: _Inputs, end: torch.fx.Node):
    """(args, kwargs, return_residual) for one way of calling the op, or _Miss if its result differs."""
    pattern = core.inner | {core.out} | set(core.upcasts) | {n for _, n, _ in core.tail} | set(inputs.folded)
    crossing = state_crossing(pattern | {end})
    if crossing:
        raise _Miss(crossing)
    writer = out_writer(pattern)
    if writer is not None:
        raise _Miss(f"{writer.name} also writes its result into out=, which the fused op would not")
    _check_rounding_kept(core.tail, end)
    for what, operand in (("weight", core.weight), ("bias", core.bias)):
        # F.layer_norm(h, (N,), weight=f(h)): the op would read a value computed from its own residual output,
        # a cycle in the graph (the hand-written weights and the tail's are checked where they are found)
        if operand is not None and _depends_on(operand, pattern):
            raise _Miss(f"the {what} {operand.name} is computed from the normalised tensor or its inputs' "
                        "sum: the fused op cannot read it")
    h = inputs.h
    if inputs.rows_perm is not None:
        # a view of the sum read elsewhere too would keep the sum alive beside the op (computed twice)
        shared = [v for v in inputs.folded if v is not h and any(u not in pattern for u in v.users)]
        if shared:
            raise _Miss(f"{shared[0].name}, a view of the sum between it and the norm, has other readers")
    return_residual = h is not None and any(u not in pattern for u in h.users)
    args = (inputs.x, inputs.residual, core.weight, core.bias)
    kwargs = {"eps": core.eps, "dropout_p": inputs.dropout_p, "is_rms_norm": core.is_rms,
              "return_residual": return_residual}
    try:
        result = _fake_result(_taking_rows(fn), args, kwargs)
    except Exception as e:  # noqa: BLE001 - the op's own input checks say what it cannot take
        raise _Miss(f"the fused op does not take these inputs: {str(e).splitlines()[0][:200]}") from None
    out = result[0] if return_residual else result
    want = tensor_meta(end)
    if inputs.rows_perm is not None and isinstance(out, torch.Tensor):
        out = _rows_back(out, inputs.rows_perm, want)
    if want is None or not isinstance(out, torch.Tensor):
        raise _Miss("no shape/dtype metadata to check the fused op's result against")
    if out.dtype != want.dtype:
        raise _Miss(f"the fused op would return {out.dtype}, eager returns {want.dtype}")
    if not _same_shape(out, want):
        raise _Miss(f"the fused op would return shape {tuple(out.shape)}, eager {tuple(want.shape)}")
    if return_residual:
        res, hv = result[1], tensor_meta(h)
        if res.dtype != hv.dtype or not _same_shape(res, hv):
            raise _Miss(f"the residual output would be {res.dtype}, eager's sum is {hv.dtype}")
    _check_not_written(pattern, end, args)
    _check_saved_not_written(pattern, args, kwargs, h if return_residual else None, core)
    return args, kwargs, return_residual, pattern


def _check_rounding_kept(tail, end: torch.fx.Node) -> None:
    """A folded cast that rounds (fp32 -> bf16 / fp16) is the op's own rounding of its result only when
    nothing after it widens the value again: ``norm(x).bfloat16() * w_fp32`` or ``.half().float()`` is an fp32
    result with bf16 / fp16 precision, which the op, rounding once to its fp32 output, would not give."""
    want = tensor_meta(end)
    for kind, node, _ in tail:
        if kind != "cast" or _is_exact_cast(node) or want is None:
            continue
        dtype = tensor_meta(node).dtype
        if torch.promote_types(dtype, want.dtype) != dtype:
            raise _Miss(f"the normalised value is rounded to {dtype} by {node.name} and widened to "
                        f"{want.dtype} after it: the fused op would not round it there")


def _check_not_written(pattern: set[torch.fx.Node], end: torch.fx.Node, op_inputs: tuple) -> None:
    """No tensor the pattern reads is written in place outside it before it ends: dynamo's graph can read a
    tensor by the same node before and after ``x.mul_(3)``, and then no single value is normalised.

    Except a write that runs before every node of the pattern that reads the tensor, and before the op's
    place (insert_call: right after its last input): eager's pattern and the op then both read the written
    value. fairseq's wav2vec 2.0 encoder zeroes the padded frames in place (``x[padding_mask] = 0``), then
    reads x again for its positional conv and for ``x + x_conv`` before the LayerNorm (review s32: a near
    miss). A tensor the pattern computes itself is never such an input: the op computes it unwritten."""
    found = written_before_end(pattern, end)
    if found is None:
        return
    order = {n: i for i, n in enumerate(end.graph.nodes)}
    inputs = [a for a in op_inputs if isinstance(a, torch.fx.Node)]
    place = max((order[a] for a in inputs), default=-1)
    reads = {a for n in pattern for a in n.all_input_nodes} - pattern
    for node in sorted(reads | pattern, key=order.__getitem__):
        readers = [order[n] for n in pattern if node in n.all_input_nodes]
        for writer in in_place_writers(node, pattern):
            if not order[node] < order[writer] < order[end]:
                continue
            if node in reads and readers and order[writer] < min(readers) and order[writer] < place:
                continue  # every read, the op's included, comes after the write
            raise _Miss(f"{node.name} is written in place by {writer.name} ({op_name(writer)}) before the "
                        "norm ends: what it reads depends on where it runs")


def _check_saved_not_written(pattern: set[torch.fx.Node], args: tuple, kwargs: dict,
                             returned_h: torch.fx.Node | None, core: _Core) -> None:
    """No tensor the op saves for its backward is written in place after it, unless eager saved it too
    (review s29).

    The op saves h (its residual output: the pre-norm sum, which the users of ``returned_h`` then read) or,
    when it stores none (no residual, no dropout), x itself, and the weight and bias. A write to one of them
    after the norm, ``h += attn(norm(h))`` (a pre-norm block updating its residual stream in place) or
    ``x.mul_(2)``, bumps its version and fails the op's backward, where eager's hand-written norm saved only
    what it computed from them (``x - mean``, Llama's ``x.float()`` of a bf16 x; F.rms_norm too, of a bf16 x)
    and trains. F.layer_norm saves its own input, weight and bias: a write to those fails eager's backward as
    it fails the op's, and is left to the fusion. Where the graph runs with grad disabled throughout nothing
    is saved, and the write is harmless."""
    if records_no_grad(next(iter(pattern)).graph):
        return
    x, residual, weight, bias = args
    stores_h = returned_h is not None or residual is not None or kwargs["dropout_p"] > 0.0
    saved = [("the pre-norm sum", returned_h), ("the input", None if stores_h else x), ("the weight", weight),
             ("the bias", bias)]
    saved_by_eager = set()
    if is_op(core.anchor, "layer_norm"):
        saved_by_eager = {arg(core.anchor, i, name) for i, name in ((0, "input"), (2, "weight"), (3, "bias"))}
    for what, node in saved:
        if not isinstance(node, torch.fx.Node) or node in saved_by_eager:
            continue
        writers = in_place_writers(node, pattern)
        if writers:
            writer = writers[0]
            raise _Miss(f"{what} {node.name} is written in place by {writer.name} ({op_name(writer)}) after "
                        "the norm: the fused op saves it for its backward, which would then fail where "
                        "eager's does not")


def _taking_rows(fn):
    """fn called with its weight and bias as the (n,) rows _apply passes it (see _row_input)."""
    def call(x, residual, weight, bias, **kwargs):
        return fn(x, residual, _as_row(weight), _as_row(bias), **kwargs)
    return call


def _row_input(graph, node: torch.fx.Node | None, like: torch.fx.Node) -> torch.fx.Node | None:
    """node, or ``node.reshape(-1)`` for a weight / bias kept with leading singleton dims: the (n,) row the
    op takes. Autograd through the reshape gives the parameter's gradient back in its own shape."""
    t = tensor_meta(node)
    if t is None or t.dim() <= 1:
        return node
    return insert_call(graph, torch.reshape, (node, (-1,)), like=like)


def _fake_result(fn, args, kwargs):
    result = fake_call(fn, args, kwargs)
    if result is None:
        raise RuntimeError("no fake mode for the inputs")
    return result


def _choose(fn, core: _Core):
    """The most fused way to call the op that gives eager's result: (core, inputs, end node, plan)."""
    _check_inner(core)
    _widen_tail(core)
    n, rank = tensor_meta(core.x).shape[-1], _rank(core.out)
    for w, what in ((core.weight, "weight"), (core.bias, "bias")):
        if w is not None and not _is_row(tensor_meta(w), n, rank):
            raise _Miss(f"{what} is not a row of the normalised size ({n},)")
    # Preferred first: input upcasts folded into the op, then kept as the op's input; the whole tail
    # folded, then shorter ones (what is left runs after the op, as eager ran it: an fp32 bias on a
    # bf16 norm promotes there). The first way whose result matches eager's dtype and shape is used.
    tails = [core.tail[:k] for k in range(len(core.tail), -1, -1)]
    heads = [(core.x, core.upcasts)] + ([(core.upcasts[0], [])] if core.upcasts else [])
    first_miss = None
    for head, upcasts in heads:
        for inputs in _input_options(head):
            for tail in tails:
                weight, bias = _affine(core, tail)
                pattern_core = _Core(core.variant, core.is_rms, head, upcasts, core.eps, weight, bias,
                                     core.out, core.anchor, core.inner, tail)
                end = tail[-1][1] if tail else core.out
                try:
                    plan = _plan(fn, pattern_core, inputs, end)
                except _Miss as miss:
                    first_miss = first_miss or miss
                    continue
                return pattern_core, inputs, end, plan
    raise first_miss


def _apply(graph, fn, core: _Core, inputs: _Inputs, end, plan) -> tuple[set[torch.fx.Node], str]:
    """Insert the op call, reroute the users of what it replaces, erase the pattern."""
    args, kwargs, return_residual, pattern = plan
    x, residual, weight, bias = args
    args = (x, residual, _row_input(graph, weight, core.anchor), _row_input(graph, bias, core.anchor))
    fused = insert_call(graph, fn, args, kwargs, like=core.anchor)
    if return_residual:
        out = insert_getitem(graph, fused, 0)
        residual = insert_getitem(graph, fused, 1)
        inputs.h.replace_all_uses_with(residual, delete_user_cb=lambda u: u not in pattern)
    else:
        out = fused
    if inputs.rows_perm is not None and inputs.rows_perm != sorted(inputs.rows_perm):
        out = insert_call(graph, torch.permute, (out, inputs.rows_perm), like=core.anchor)
        if _layout_of_norm_output(tensor_meta(end)):
            out = insert_call(graph, torch.Tensor.contiguous, (out,), like=core.anchor)
    end.replace_all_uses_with(out)
    erase_unused(graph, pattern)
    return pattern, _describe(core, inputs, return_residual)


def rewrite(graph: torch.fx.Graph) -> None:
    fn = _fused_op()
    if fn is None:
        return
    _float_inputs_to_specialise.clear()
    decisions = []  # reported once the run is known to stand (see the end)
    # (node, its mean when the node is one): the mean is found once, here, not again by the matcher
    anchors = []
    for n in graph.nodes:
        if is_op(n, "layer_norm", "rms_norm", "var_mean", "std_mean") or _two_norm(n) is not None:
            anchors.append((n, None))
        elif (mean := _as_mean(n)) is not None:
            anchors.append((n, mean))
    done: set[torch.fx.Node] = set()
    for node, mean in anchors:
        if node in done:
            continue
        core = None
        variant = "norm"
        try:
            if is_op(node, "layer_norm", "rms_norm"):
                variant = "F.rms_norm" if is_op(node, "rms_norm") else "F.layer_norm"
                core = _match_norm_call(node)
            elif is_op(node, "var_mean", "std_mean"):
                variant = "hand-written LayerNorm"
                core = _match_var_mean(node)
            elif mean is None:
                variant = "hand-written RMSNorm (2-norm / sqrt(N))"
                core = _match_two_norm_rms(node)
            else:
                variant = "hand-written LayerNorm"
                core = _match_layer(mean)
                if core is None:
                    variant = "hand-written RMSNorm"
                    core = _match_rms(mean)
            if core is None:
                continue
            choice = _choose(fn, core)
        except Exception as e:  # noqa: BLE001 - a matcher bug must cost a fusion, never the compile
            reason = str(e) if isinstance(e, _Miss) else f"matcher error {type(e).__name__}: {e}"
            variant = core.variant if core is not None else variant
            decisions.append((record_near_miss, (FAMILY, variant, reason, node)))
            if core is not None:
                done |= core.inner
            continue
        pattern, description = _apply(graph, fn, *choice)
        done |= pattern
        decisions.append((record_rewrite, (FAMILY, description, _OP_NAME, core.anchor)))
    if _float_inputs_to_specialise:
        # dynamic=True made a module float (eps, dropout p) a graph input, and the rewrite baked its
        # value in. Inductor would specialise it anyway and restart dynamo's analysis, running this pass
        # a second time; restarting now, with the floats marked as constants, keeps the counts honest.
        # Dynamo throws this graph away on the restart, erasing it last node first, which fails on a node
        # still read by one placed before it: the op calls this pass and those before it inserted after
        # their inputs, ahead of run_passes' final sort (review s32: Phi-1.5 under dynamic=True crashed).
        stable_topological_sort(graph)
        restart_with_specialised_floats(_float_inputs_to_specialise)
    for record, args in decisions:
        record(*args)
