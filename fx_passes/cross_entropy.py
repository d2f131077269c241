"""Cross-entropy family: F.cross_entropy (or F.nll_loss of a log_softmax) over a Linear's logits -> flash
linear_cross_entropy.

Why: a language-model head's logits are the largest tensor of a training step (BERT-base: 16384 x 30522
in bf16, 1 GB), and around them eager and Inductor add a bias pass, a log-softmax forward and backward and,
because 30522 is not a multiple of 8, a copy of the gradient into padded rows for the GEMMs. The fused op
(flash_backend/ops/cross_entropy.py) writes the logits once, in padded rows, from the GEMM's epilogue and
reads them once forward and once backward.

What is matched, on the Torch IR dynamo produces: ``F.cross_entropy(input, target, ...)``
(``nn.CrossEntropyLoss`` and transformers' loss functions call it) whose 2-D ``input`` is, through a chain of

- reshapes that keep the class dimension last and flatten the leading ones ((..., V) -> (M, V):
  ``view``/``reshape``/``flatten``), and ``contiguous()``,
- at most one cast of fp16/bf16 logits up to fp32 (``.float()``, ``.to(torch.float32)``; transformers'
  causal-LM loss upcasts first),
- selections of rows: ``logits[..., :-1, :]`` (the causal-LM shift as older transformers models and much
  training code write it), any index of ints and slices (steps included) on the dimensions before the class
  one, which it leaves whole, a boolean mask of leading dimensions alone (``logits[labels != -100]``, where
  dynamo captures it: capture_dynamic_output_shape_ops), ``narrow`` and ``select`` of a dimension before the
  class one and an item of ``unbind`` of one (_row_selection), made before any reshape that regroups the
  rows. Each picks every row at most once, in row-major order, and the Linear acts row-wise, so that is the
  loss over every row with the other rows' targets set to ignore_index; the op gets that target (built in
  the graph by a scatter) and still returns the full logits (_target_of_every_row),
- permutations of the dimensions before the class one, which stays last (_row_permutation): sequence-first
  (S, B, V) logits moved batch-first, ChatGLM2/3's ``lm_logits.transpose(0, 1).contiguous()`` then
  ``.to(torch.float32)``, the shift and ``view(-1, V)``, Megatron's ``output.transpose(0, 1)``, fairseq-style
  T x B x C decoders, nn.Transformer with batch_first=False (``transpose(0, 1)``, ``permute(1, 0, 2)``,
  ``movedim`` / ``moveaxis``, ``swapaxes`` / ``swapdims``, any number of leading dimensions). Each maps the
  Linear's rows one-to-one onto the rows after it, so with the selections, in their order, it is replayed on
  a grid of the Linear's row numbers: the grid, flattened, names for each row of the loss the Linear row it
  is; the op gets the target of every Linear row (scattered there), its per-row loss (reduction='none') is
  read back at those positions, in eager's order, and the logits it returns, in the Linear's layout, feed
  the permutation's node where the model also returns the permuted logits (ChatGLM's ``lm_logits``). A row
  selection or permutation after a reshape that regrouped the rows is left alone (its index or dimensions
  mean rows of another shape); a regrouping reshape after the last of them (the final ``view(-1, V)``) keeps
  the row order and is taken,

the output of ``F.linear(x, weight, bias)`` (``nn.Linear``) or of a matmul with a 2-D weight's transpose
(``h @ self.wte.weight.T``, a tied head written out: ATen's bias-free F.linear is that matmul), of
``torch.addmm(b, x, w.t())`` with beta = alpha = 1 and a class bias b (ATen's F.linear of a 2-D input), of an
einsum that is a Linear (``"btd,vd->btv"``, ``"nd,vd->nv"``: _einsum_linear), or of a bias-free one of these
plus a class bias of shape (V,) or (1, .., 1, V) (BART's ``lm_head(h) + final_logits_bias``), which becomes
the op's bias; or a Linear's output times or over a number s that is a power of two, its only reader (the
head's logit scale: Cohere's ``logits * logit_scale`` = 1/16, Granite's ``logits / logits_scaling``), fp32 or
bf16: the op then gets the weight and bias times s (_scale_factor says why that is exact). The logits keep
every other user: the op returns them too, so a model that also returns them (``.logits``) still does. A
label_smoothing or ignore_index that dynamic=True made a symbolic input (a loss module stored on the model)
is specialised, with a guard, once every other check has passed.

Also an (N, C, d1, ..) input, whose classes F.cross_entropy reads at dim 1, with a target (N, d1, ..), when
it is such logits L, (N, d1, .., C), with their class dimension moved to dim 1 and the others kept in order:
``F.cross_entropy(logits.transpose(1, 2), y)`` (``permute(0, 2, 1)``, ``transpose(-1, -2)``, ``.mT``,
``movedim(-1, 1)``; seq2seq and token-classification code), then possibly ``contiguous()`` and a cast up to
fp32. The loss at (n, i..) is then that of L's row (n, i..) with the target's (n, i..): the op gets the target
flattened, row-major as L's rows, and its per-row loss (reduction='none') is reshaped as the target, as
eager's is (_classes_moved_to_dim_1). A permutation P that puts the class dimension at 1 and reorders the
others as well (the one-step ``logits.permute(1, 2, 0)`` of sequence-first (S, B, V) logits into (B, V, S),
``permute(1, -1, 0)``, ``movedim(0, -1)``, 4-D ones) is the row permutation q = (P[0], P[2], ..) with the
class dimension kept last, followed by that class move (``permute(1, 0, 2)`` then ``transpose(1, 2)``, which
is taken as such): q is replayed on the grid of row numbers as the row permutations above are, the last
of the row steps (_row_permutation with class_move, _row_steps), and the rest is the class move's path.

The same function spelled ``F.nll_loss(F.log_softmax(z, dim=-1), target, ...)`` (``nn.NLLLoss`` and
``nn.LogSoftmax`` modules are inlined by dynamo to these two calls; ``torch.log_softmax``,
``torch.special.log_softmax`` and ``z.log_softmax(-1)`` too, these three also with NumPy's ``axis=`` for
dim), with z the chain above, is matched as well: ATen's cross_entropy computes exactly that for
class-index targets. The log_softmax must be over z's last dimension (``-1``, or ``1`` / F.log_softmax's
implicit dim on a 2-D z), computed in z's dtype or with
``dtype=torch.float32`` (z cast up first: the upcast above), and its output, possibly reshaped keeping the
class dimension last (``F.log_softmax(logits, -1).view(-1, V)``) or with rows selected or permuted as
above (``F.log_softmax(logits, -1).transpose(0, 1)`` of sequence-first logits: the log_softmax is row-wise,
so that is a selection or permutation of the logits' rows), must be read by the nll_loss only: the op does
not return log-probabilities. With classes at dim 1, the log-probabilities of logits whose classes are last
moved there (``F.log_softmax(logits, -1).transpose(1, 2)``), or the log_softmax over dim 1 of the
moved logits (``F.log_softmax(logits.transpose(1, 2), dim=1)``), as above. nll_loss's ignore_index and
reduction mean what cross_entropy's do (label_smoothing 0); its class weights and legacy arguments are left
alone as cross_entropy's are. An nll_loss whose input is not a log_softmax (seen through views, transposes
and casts) is not a candidate.

Label smoothing written out, as timm's LabelSmoothingCrossEntropy does, ``lp = F.log_softmax(z, dim=-1);
nll = -lp.gather(dim=-1, index=y.unsqueeze(1)).squeeze(1); smooth = -lp.mean(dim=-1); ((1 - s) * nll + s *
smooth).mean()`` (the negation on either side of the squeeze, the terms and factors in either order), is
F.cross_entropy(z, y, label_smoothing=s) for every target eager's gather accepts: it is replaced by that call,
rewritten as above, and put back when that fails (_hand_written_label_smoothing). Coefficients that do not sum
to 1, and fairseq's label_smoothed_nll_loss (s spread over the C - 1 other classes: another function), are not
candidates.

Left alone, with the reason reported: class weights and the legacy size_average/reduce arguments, class
probability targets, fp64 logits (the op computes the loss in fp32, eager in fp64), an input whose dim 1 is
not the Linear's last (class) dimension moved there (a Conv1d's (N, C, L) output, ``transpose(0, 2)``,
``permute(2, 1, 0)`` or ``.mT`` of 4-D logits, which put another dimension at 1), a permutation of the rows
with the class move after a reshape that regrouped them (``logits.reshape(B, S, V).permute(1, 2, 0)`` of
(S, B, V) logits), a row selection after the class move, a step in the chain that changes values or row
order in a way not mapped (a slice, step, index, narrow, select or unbind along the class dimension, a new
axis, an integer tensor index (it may pick a row twice), a mask computed from the logits, a row selection or
permutation after a reshape that regrouped the rows, a permutation that moves the class dimension from the
last (``.T`` / ``.t()`` of 2-D logits, ``.mT``, ``transpose(1, 2)`` of 3-D logits read as (M, V)
afterwards), a cast down or to fp64, a ``view(dtype)`` reinterpreting the bits), logits that do not come
from an F.linear (addmm scaled by beta or alpha or with a bias per row, an einsum that sums over rows,
reorders them or has a weight per batch, a (K, V) weight that is not a transpose), a logit scale that is
not a power of two (``* 0.3``: the weight scaled instead rounds differently) or on fp16 logits, and a tensor
the pattern reads that is written in place before the loss (``x.mul_(2)`` between the Linear and the loss),
the logits written in place at all, through any view of them (before the loss it reads the written values;
after it, the op's backward reads the logits it kept, where eager's reads its log-probabilities), and a target
computed from the logits (pseudo-labels: the op would need it before it computes them). For the nll_loss
form also: a log_softmax over another dimension, or in another dtype (fp64, a cast down), log-probabilities
used elsewhere too (returned, or written in place), and a step between the log_softmax and the nll_loss
other than such a reshape or row selection (a cast of the log-probabilities, a transpose).
"""

from __future__ import annotations

import math
import numbers
import operator
import warnings

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from flash_backend import config as flash_config
from fx_passes._compat import float_input_symbols, restart_with_specialised_floats, stable_topological_sort
from fx_passes._match import (
    arg,
    binary_operands,
    bound_arguments,
    erase_unused,
    fake_call,
    fused_op,
    in_place_writers,
    insert_call,
    insert_getitem,
    is_last_dim,
    is_number,
    is_op,
    linear_operand_writer,
    linear_operands,
    norm_dim,
    op_name,
    out_writer,
    state_crossing,
    tensor_meta,
    val,
    written_before_end,
)
from fx_passes._report import record_near_miss, record_rewrite

FAMILY = "cross_entropy"

_OP_MODULE = "flash_backend.ops.cross_entropy"
_OP_NAME = "flash.linear_cross_entropy_fwd (linear_cross_entropy)"
_RESHAPES = {"view", "reshape", "flatten", "contiguous"}
_CASTS = {"float", "to", "type"}
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _Miss(Exception):
    """A candidate that is not provably the same function; the message is the reason."""


def _fused_op():
    return fused_op(_OP_MODULE, "linear_cross_entropy")


def _arguments(ce: torch.fx.Node) -> dict:
    args = bound_arguments(ce, F.cross_entropy)
    if args is None:
        raise _Miss("cannot read the arguments of F.cross_entropy")
    return args


# The symbols of dynamo's float inputs (zf0, ...) whose values this run of the pass baked in; see rewrite().
_float_inputs_to_specialise: list = []


def _symbolic_scalar(value: object) -> bool:
    """A node whose value is a SymFloat / SymInt: with dynamic=True dynamo makes the number attributes of
    a module (``self.loss_fct = nn.CrossEntropyLoss()``'s label_smoothing: DistilBERT's MLM head) inputs."""
    return isinstance(value, torch.fx.Node) and isinstance(val(value), (torch.SymFloat, torch.SymInt))


def _specialise(args: dict, name: str):
    """The constant value of args[name], a number or a symbolic scalar that is then specialised: dynamo
    guards on it (a change recompiles), and a float input is restarted as a constant (see rewrite())."""
    value = args[name]
    if not _symbolic_scalar(value):
        return value
    v = val(value)
    try:
        constant = float(v) if isinstance(v, torch.SymFloat) else int(v)
    except Exception:  # noqa: BLE001 - data-dependent: there is no value to specialise on
        raise _Miss(f"{name}={value.name} is not a constant (data-dependent)") from None
    symbol = getattr(v.node, "_expr", None)
    if isinstance(v, torch.SymFloat) and symbol is not None:
        _float_inputs_to_specialise.extend(symbol.free_symbols)
    return constant


def _check_arguments(args: dict) -> None:
    if args["weight"] is not None:
        raise _Miss("class weights are not supported by the fused op")
    if args["size_average"] is not None or args["reduce"] is not None:
        raise _Miss("the legacy size_average/reduce arguments are given")
    if args["reduction"] not in ("mean", "sum", "none"):
        raise _Miss(f"reduction={args['reduction']!r} is not a constant 'mean', 'sum' or 'none'")
    ignore_index, smoothing = args["ignore_index"], args["label_smoothing"]
    if _symbolic_scalar(ignore_index) and isinstance(val(ignore_index), torch.SymInt):
        pass  # specialised once every other check has passed (_rewrite_one)
    elif not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise _Miss(f"ignore_index={ignore_index!r} is not a constant int")
    if _symbolic_scalar(smoothing):
        pass  # likewise; its range is checked then
    elif not isinstance(smoothing, numbers.Real) or isinstance(smoothing, bool) or \
            not 0.0 <= smoothing <= 1.0:
        raise _Miss(f"label_smoothing={smoothing!r} is not a constant in [0, 1]")
    inp, target = tensor_meta(args["input"]), tensor_meta(args["target"])
    if inp is None or target is None:
        raise _Miss("the input or target has no tensor metadata")
    if inp.dim() < 2:
        raise _Miss(f"the input is {inp.dim()}-D: only (M, classes) inputs, whose class dimension is the "
                    "last, and (N, classes, d1, ..) ones are fused")
    if inp.dim() == 2 and (target.dtype != torch.int64 or target.dim() != 1):
        raise _Miss(f"the target is {target.dtype} {tuple(target.shape)}, not (M,) int64 class indices")
    rows = (inp.shape[0], *inp.shape[2:])
    if inp.dim() > 2 and (target.dtype != torch.int64 or target.dim() != len(rows) or not all(
            statically_known_true(a == b) for a, b in zip(target.shape, rows, strict=True))):
        raise _Miss(f"the target is {target.dtype} {tuple(target.shape)}, not (N, d1, ..) int64 class "
                    f"indices for the {inp.dim()}-D input, whose classes are at dim 1")


def _is_reshape_keeping_classes(step: torch.fx.Node, source: torch.fx.Node) -> bool:
    """A reshape of (..., V) into (..., V): row-major, so it only regroups the rows. Not ``view(dtype)``,
    which keeps the shape between same-size dtypes (fp16 <-> bf16) but reinterprets the bits."""
    out, inp = tensor_meta(step), tensor_meta(source)
    return out is not None and inp is not None and out.dim() >= 1 and inp.dim() >= 1 and \
        out.shape[-1] == inp.shape[-1] and out.dtype == inp.dtype


def _is_upcast(step: torch.fx.Node, source: torch.fx.Node) -> bool:
    out, inp = tensor_meta(step), tensor_meta(source)
    return out is not None and inp is not None and out.dtype == torch.float32 and \
        inp.dtype in (*_LOW_PRECISION, torch.float32) and out.device == inp.device and out.shape == inp.shape


_PERMUTES = {"transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "adjoint"}


def _permutation(node: object) -> tuple[torch.fx.Node, list[int]] | None:
    """(t, p) when node is t with its dimensions permuted, its dimension i being t's p[i]: ``transpose`` /
    ``swapaxes`` / ``swapdims``, ``permute``, ``movedim`` / ``moveaxis`` (any spelling, dims by keyword too),
    ``.mT``, ``.mH`` and ``adjoint()`` (the conjugate of a real tensor is itself), ``.T``; else None. The
    permutation is read from the call itself, run on a meta tensor of sizes 2, 3, .. (each stride of the
    result names the dimension it came from), so that every spelling means what torch makes of it."""
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method") or \
            not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    source, inp, out = node.args[0], tensor_meta(node.args[0]), tensor_meta(node)
    if node.op == "call_function" and node.target is getattr:
        if node.args[1:] not in (("mT",), ("mH",), ("T",)):
            return None
        fn = getattr
    elif op_name(node) in _PERMUTES:
        fn = node.target if node.op == "call_function" else getattr(torch.Tensor, node.target)
    else:
        return None
    computed: list[torch.fx.Node] = []  # a dimension computed in the graph: not a constant permutation
    torch.fx.node.map_arg((node.args[1:], node.kwargs), computed.append)
    if inp is None or out is None or inp.dim() < 2 or out.dim() != inp.dim() or inp.is_complex() or computed:
        return None
    probe = torch.empty(tuple(range(2, inp.dim() + 2)), device="meta")
    try:
        with warnings.catch_warnings():  # .T beyond 2-D is deprecated: eager's call warns, not this one
            warnings.simplefilter("ignore")
            permuted = fn(probe, *node.args[1:], **node.kwargs)
    except Exception:  # noqa: BLE001 - arguments torch refuses: no permutation to read
        return None
    strides = list(probe.stride())
    if not isinstance(permuted, torch.Tensor) or sorted(permuted.stride()) != sorted(strides):
        return None
    return source, [strides.index(s) for s in permuted.stride()]


def _row_permutation(node: object, class_move: bool = False) -> list[int] | None:
    """The permutation of the leading (row) dimensions when node permutes the logits' dimensions before the
    class one and leaves that one last (``logits.transpose(0, 1)`` of sequence-first (S, B, V) logits,
    ``permute(1, 0, 2)``, ``movedim(0, 1)``, ``swapaxes``): q such that node's rows are its input's rows
    with their leading index permuted by q, ``rows.permute(q)`` for a tensor ``rows`` of the input's leading
    shape. Each row is then a row of the input, every one once. None for any other node, a permutation that
    moves the class dimension included (``.T``, ``.mT``, ``transpose(1, 2)`` of 3-D logits).

    class_move: node is the permutation that moves the logits' classes to dim 1 for the loss
    (_classes_moved_to_dim_1), p with p[1] their last dimension. p is then the row permutation
    q = (p[0], p[2], ..), the class dimension kept last, followed by the class move ``movedim(-1, 1)``
    (``permute(1, 2, 0)`` of (S, B, V) logits is ``permute(1, 0, 2)``, then ``transpose(1, 2)``): q, the
    identity for the class move alone; None when p[1] is another dimension."""
    permuted = _permutation(node)
    if permuted is None:
        return None
    p = permuted[1]
    if class_move:
        return [p[0], *p[2:]] if len(p) > 2 and p[1] == len(p) - 1 else None
    return p[:-1] if p[-1] == len(p) - 1 else None


def _classes_moved_to_dim_1(node: torch.fx.Node, casts: bool = True
                            ) -> tuple[list[torch.fx.Node], torch.fx.Node, bool]:
    """(the steps from node back to a permutation, latest first and the permutation last; its input; whether a
    step casts up) when node, an (N, C, d1, .., dk) input whose classes F.cross_entropy and F.nll_loss read at
    dim 1, is logits L of shape (N, d1, .., dk, C) with their last (class) dimension moved to dim 1 and the
    others kept in order: ``L.transpose(1, 2)``, ``L.permute(0, 2, 1)``, ``L.mT``, ``L.transpose(-1, -2)``,
    ``L.movedim(-1, 1)``, followed by ``contiguous()`` and, where casts, casts up to fp32 (_is_upcast).
    Element (n, c, i..) is then L[n, i.., c], so the loss at (n, i..) is the loss of L's row (n, i..) with the
    target's (n, i..), and the loss over the rows of L, in the target's row-major order: what the fused op
    computes from L's Linear with the target flattened. Also a permutation that reorders L's other dimensions
    as it moves the classes to dim 1 (``permute(1, 2, 0)`` of sequence-first (S, B, V) logits into (B, V, S)):
    that is a permutation of L's rows, the classes kept last, then the class move (_row_permutation with
    class_move), and the row permutation is replayed on the rows' numbers as any other is (_row_steps).
    ([], node, False) for a 2-D node; else _Miss: a permutation that leaves another dimension at 1
    (``transpose(0, 2)``: the classes at 0), a class dimension at 1 that comes from no transpose of L (a
    Conv1d's output), or a step between."""
    meta = tensor_meta(node)
    if meta is None or meta.dim() <= 2:
        return [], node, False
    n, steps, upcast = meta.dim(), [], False
    while (permuted := _permutation(node)) is None:
        name = op_name(node)
        source = node.args[0] if isinstance(node, torch.fx.Node) and node.args else None
        if name == "contiguous" and isinstance(source, torch.fx.Node) and _same_shape(node, source):
            pass
        elif casts and name in _CASTS and isinstance(source, torch.fx.Node) and _is_upcast(node, source):
            upcast = upcast or tensor_meta(source).dtype != torch.float32
        else:
            what = f"{name or getattr(node, 'target', node)} ({getattr(node, 'name', node)})"
            through = "contiguous() and casts up to fp32" if casts else "contiguous()"
            raise _Miss(f"the input is {n}-D, its classes at dim 1, and comes from {what}, not from a "
                        f"transpose of logits whose class dimension is the last (through {through} only)")
        steps.append(node)
        node = source
    source, p = permuted
    if _row_permutation(node, class_move=True) is None:
        raise _Miss(f"the input is {n}-D, its classes at dim 1, and {node.name} permutes the logits' "
                    f"dimensions by {tuple(p)}: it does not move their last (class) dimension to dim 1 (as "
                    f"{(0, n - 1, *range(1, n - 1))} does, the other dimensions possibly reordered too)")
    return [*steps, node], source, upcast


def _transposed_2d(node: object) -> torch.fx.Node | None:
    """w when node is w's transpose, w 2-D: ``w.t()``, ``torch.t(w)``, ``w.T``, ``w.mT``,
    ``w.transpose(0, 1)`` (either order, negative dims too), ``w.permute(1, 0)``; else None."""
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method") or \
            node.kwargs or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    w, out = node.args[0], tensor_meta(node)
    if tensor_meta(w) is None or tensor_meta(w).dim() != 2 or out is None or out.dim() != 2:
        return None
    rest = node.args[1:]
    if node.op == "call_function" and node.target is getattr:  # w.T / w.mT, as dynamo records them
        return w if rest in (("T",), ("mT",)) else None
    name = op_name(node)
    if name == "t" and not rest:
        return w
    dims = rest[0] if name == "permute" and len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
    if len(dims) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return None
    if name in ("transpose", "swapaxes", "swapdims"):  # dims 0 and 1 in either order, or as -2 and -1
        return w if sorted(d % 2 for d in dims) == [0, 1] else None
    return w if name == "permute" and [d % 2 for d in dims] == [1, 0] else None


def _linear_operands(node: object) -> tuple | None:
    """(x, weight, bias, the transpose of weight or None) when node computes F.linear(x, weight, bias):
    an ``F.linear`` call (``nn.Linear``), or ``x @ w.t()`` (``torch.matmul``, ``Tensor.matmul``, ``torch.mm``;
    any spelling of the transpose, _transposed_2d) with w 2-D, the tied-embedding head written out
    (``h @ self.wte.weight.T``). A bias-free F.linear is that matmul: ATen's linear computes
    ``matmul(input, weight.t())`` when there is no bias. Also ``torch.addmm(b, x, w.t())`` (beta = alpha = 1,
    b a class bias: ATen's F.linear of a 2-D input with a bias is that addmm) and an einsum that is a
    Linear (_einsum_linear). Else None."""
    if is_op(node, "linear"):
        return (*linear_operands(node), None)
    if is_op(node, "addmm"):
        return _addmm_linear(node)
    if is_op(node, "einsum"):
        return _einsum_linear(node)
    if not is_op(node, "matmul", "mm") or len(node.args) != 2 or node.kwargs:
        return None
    x, transposed = node.args
    weight = _transposed_2d(transposed)
    xt = tensor_meta(x)
    if weight is None or xt is None or xt.dim() < 1 or (is_op(node, "mm") and xt.dim() != 2):
        return None
    return x, weight, None, transposed


def _class_bias_shape(b: torch.Tensor, logits: torch.Tensor) -> bool:
    """b is shaped (V,) or (1, .., 1, V), with no more dimensions than the logits: added to every row."""
    return 1 <= b.dim() <= logits.dim() and all(statically_known_true(n == 1) for n in b.shape[:-1]) and \
        statically_known_true(b.shape[-1] == logits.shape[-1])


def _is_class_bias(bias: object, logits: object) -> bool:
    """bias is a class bias (_class_bias_shape) in the logits' dtype: the bias of an F.linear."""
    b, out = tensor_meta(bias), tensor_meta(logits)
    return b is not None and out is not None and b.dtype == out.dtype and _class_bias_shape(b, out)


def _addmm_linear(node: torch.fx.Node) -> tuple | None:
    """``torch.addmm(b, x, w.t())`` / ``b.addmm(x, w.t())`` with beta = alpha = 1 and b a class bias:
    ``b + x @ w.t()``, F.linear(x, w, b) (which ATen computes with that addmm). A bias of shape (M, V) (a
    value per row), scaled operands, or a right operand that is not a 2-D transpose are not a Linear."""
    if len(node.args) != 3 or any(k not in ("beta", "alpha") or v != 1 for k, v in node.kwargs.items()):
        return None
    bias, x, transposed = node.args
    weight, xt = _transposed_2d(transposed), tensor_meta(x)
    if weight is None or xt is None or xt.dim() != 2 or not _is_class_bias(bias, node):
        return None
    return x, weight, bias, transposed


def _einsum_linear(node: torch.fx.Node) -> tuple | None:
    """(x, weight, None, transpose or None) for an einsum that is F.linear(x, weight): two operands, one
    (x) indexed by its rows' letters then the contracted one, the other 2-D (the weight: class and
    contracted letters, ``"btd,vd->btv"``, ``"nd,vd->nv"``, ``"...d,vd->...v"``, either operand first), and
    the output x's rows' letters in their order then the class letter. Also a weight written transposed,
    ``"btd,dv->btv"`` with ``w.t()``. Every other equation (a sum over rows, a batched weight, the class
    dimension elsewhere, an implicit output) is not a Linear."""
    if node.kwargs or len(node.args) < 2 or not isinstance(node.args[0], str):
        return None
    operands = node.args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    equation = node.args[0].replace(" ", "")
    if len(operands) != 2 or equation.count("->") != 1:
        return None
    inputs, out = equation.split("->")
    subscripts = inputs.split(",")
    if len(subscripts) != 2 or not all(isinstance(o, torch.fx.Node) for o in operands):
        return None
    pairs = list(zip(subscripts, operands, strict=True))
    for (w_sub, w), (x_sub, x) in (pairs, pairs[::-1]):
        rows, contracted = x_sub[:-1], x_sub[-1:]
        letters = rows[3:] if rows.startswith("...") else rows
        if len(w_sub) != 2 or not w_sub.isalpha() or not contracted.isalpha() or \
                not (letters.isalpha() or not letters) or \
                len(set(letters + w_sub)) != len(letters) + 2 or contracted not in w_sub:
            continue
        classes = w_sub.replace(contracted, "")
        xt, wt = tensor_meta(x), tensor_meta(w)
        if out != rows + classes or xt is None or wt is None or wt.dim() != 2 or \
                (not rows.startswith("...") and xt.dim() != len(x_sub)) or xt.dim() < 1:
            continue
        if w_sub == classes + contracted:  # (V, K): the weight itself
            return x, w, None, None
        weight = _transposed_2d(w)  # (K, V): a Linear only when it is the transpose of a (V, K) weight
        if weight is not None:
            return x, weight, None, w
    return None


def _added_bias(add: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(linear, bias) when add is ``F.linear(x, w) + b`` (either order) with b a class bias: a tensor of the
    logits' dtype, shaped (V,) or (1, .., 1, V), so the sum is the logits of F.linear(x, w, b.reshape(-1))
    (BART's, mBART's and Pegasus' ``lm_head(h) + final_logits_bias``); else None, or _Miss with the reason
    when the shape is there but something else is not."""
    pair = binary_operands(add, "add")
    if pair is None or not all(isinstance(a, torch.fx.Node) for a in pair):
        return None
    linears = [(a, b) for a, b in (pair, pair[::-1]) if _linear_operands(a) is not None and b is not a]
    if not linears:
        return None
    linear, bias = linears[0]
    out, logits, b = tensor_meta(add), tensor_meta(linear), tensor_meta(bias)
    if out is None or logits is None or b is None or not _class_bias_shape(b, logits):
        return None  # not a class bias: left to the chain walk's own reason
    if _linear_operands(linear)[2] is not None:
        raise _Miss(f"the logits add a second bias ({bias.name}) to a Linear that has one")
    if b.dtype != logits.dtype or out.dtype != logits.dtype:
        raise _Miss(f"the bias {bias.name} ({b.dtype}) added to the {logits.dtype} logits changes their "
                    "dtype")
    if len(linear.users) > 1:
        raise _Miss(f"the Linear's output {linear.name} is also read without the added bias {bias.name}")
    return linear, bias


def _is_index_number(item: object) -> bool:
    """An int, or a node computing one (a size under dynamic=True): not a bool, a tensor or None."""
    if isinstance(item, torch.fx.Node):
        return isinstance(val(item), torch.SymInt)
    return isinstance(item, int) and not isinstance(item, bool)


def _is_row_mask(mask: torch.fx.Node, inp: torch.Tensor) -> bool:
    """mask is a bool tensor shaped like leading dimensions of inp, not its class one: ``inp[mask]`` then
    picks whole rows, each at most once, in row-major order."""
    m = tensor_meta(mask)
    return m is not None and m.dtype == torch.bool and 1 <= m.dim() < inp.dim() and \
        all(statically_known_true(a == b) for a, b in zip(m.shape, inp.shape, strict=False))


def _row_index(step: torch.fx.Node) -> tuple | None:
    """For ``logits[index]`` that selects rows only (ints and slices on the dimensions before the class
    one, with an Ellipsis, and the class dimension untouched, its item a full ``:`` or absent): the index
    with the class item dropped, which selects the same rows of a tensor of the leading shape; else None.

    Rows only, because the Linear acts row-wise: then the sliced logits are the logits of the same rows,
    and the loss over them the loss over every row with the others ignored (_rewrite_one). So is a boolean
    mask of leading dimensions alone, ``logits[labels != -100]`` (_is_row_mask). A slice, a step or an index
    along the class dimension, a None (a new axis) or an integer tensor index (which may pick a row twice,
    counted twice by eager's loss and once by a target per row) is none of that."""
    if len(step.args) != 2 or step.kwargs:
        return None
    index = step.args[1]
    items = list(index) if isinstance(index, tuple) else [index]
    out, inp = tensor_meta(step), tensor_meta(step.args[0])
    if out is None or inp is None or inp.dim() < 2 or out.dim() < 1 or items.count(Ellipsis) > 1:
        return None
    if len(items) == 1 and tensor_meta(items[0]) is not None:
        return (items[0],) if _is_row_mask(items[0], inp) and out.dtype == inp.dtype else None
    if not all(i is Ellipsis or _is_index_number(i) or isinstance(i, slice) and
               all(p is None or _is_index_number(p) for p in (i.start, i.stop, i.step)) for i in items):
        return None
    explicit = len(items) - items.count(Ellipsis)
    if explicit > inp.dim():
        return None
    # Which item indexes the class dimension (the last): the last one when the index ends in it, after an
    # Ellipsis or spelling out every dimension; none when it stops short (the rest are implicit ':')
    reaches_last = (Ellipsis in items and items[-1] is not Ellipsis) or explicit == inp.dim()
    if reaches_last:
        last = items[-1]
        full = isinstance(last, slice) and last.start in (None, 0) and last.step in (None, 1) and \
            statically_known_true(out.shape[-1] == inp.shape[-1])
        if not full:
            return None
        items = items[:-1]
    if not statically_known_true(out.shape[-1] == inp.shape[-1]) or out.dtype != inp.dtype:
        return None
    return tuple(items)


def _narrow_signature(input, dim, start, length):
    """How torch.narrow and Tensor.narrow (self first) bind."""


def _select_signature(input, dim, index):
    """How torch.select and Tensor.select (self first) bind."""


def _unbind_signature(input, dim=0):
    """How torch.unbind and Tensor.unbind (self first) bind."""


def _row_dim(dim: object, inp: torch.Tensor) -> int | None:
    """dim as a non-negative dimension when it is a constant dimension of inp before the class one (the
    same dimension of a tensor of inp's leading shape), else None."""
    if not isinstance(dim, int) or isinstance(dim, bool) or not -inp.dim() <= dim < inp.dim():
        return None
    dim %= inp.dim()
    return dim if dim < inp.dim() - 1 else None


def _row_selection(step: torch.fx.Node) -> tuple | None:
    """(fn, arguments) when step selects rows of the logits, the class dimension left whole, such that
    ``fn(rows, *arguments)`` selects the same rows of a tensor ``rows`` of the logits' leading shape; else
    None. The selections: an index (_row_index), ``narrow`` and ``select`` of a dimension before the class
    one, and an item of ``unbind`` of such a dimension (``logits.unbind(1)[2]``: ``select(1, 2)``). Each picks
    every row at most once, in row-major order, so the loss over them is the loss over every row with the
    others' targets ignored (_target_of_every_row)."""
    if not isinstance(step, torch.fx.Node) or not step.args or not isinstance(step.args[0], torch.fx.Node):
        return None
    out = tensor_meta(step)
    if is_op(step, "getitem") and is_op(step.args[0], "unbind"):
        unbind, item = step.args[0], step.args[1] if len(step.args) == 2 and not step.kwargs else None
        args = bound_arguments(unbind, _unbind_signature)
        inp = tensor_meta(args["input"]) if args is not None and unbind.args[:1] == (args["input"],) else None
        if inp is None or out is None or not isinstance(item, int) or isinstance(item, bool):
            return None
        dim = _row_dim(args["dim"], inp)
        return (torch.select, (dim, item)) if dim is not None and out.dim() == inp.dim() - 1 else None
    if is_op(step, "getitem"):
        index = _row_index(step)
        return (operator.getitem, (index,)) if index is not None else None
    signature = {"narrow": _narrow_signature, "select": _select_signature}.get(op_name(step))
    args = bound_arguments(step, signature) if signature is not None else None
    inp = tensor_meta(args["input"]) if args is not None else None
    if inp is None or out is None or out.dtype != inp.dtype:
        return None
    dim = _row_dim(args["dim"], inp)
    indices = [args["start"], args["length"]] if "start" in args else [args["index"]]
    if dim is None or not all(_is_index_number(n) for n in indices):
        return None
    return (torch.narrow if "start" in args else torch.select, (dim, *indices))


def _head_scale(node: object) -> tuple[torch.fx.Node, object, bool] | None:
    """(the logits, c, whether it divides) when node is a Linear's logits (or those plus an added class bias,
    _added_bias) times or over a scalar c, the head's own logit scale: Cohere's ``logits *
    self.logit_scale``, Granite's ``logits / config.logits_scaling``, applied to the logits before anything
    else reads them; else None. Whether c is a power of two, which makes it the same function, is checked by
    _scale_factor."""
    for name in ("mul", "div"):
        pair = binary_operands(node, name)
        if pair is None:
            continue
        options = (pair, pair[::-1]) if name == "mul" else (pair,)
        for logits, c in options:
            if isinstance(logits, torch.fx.Node) and (_is_number(c) or _symbolic_scalar(c)) and \
                    len(logits.users) == 1 and (_linear_operands(logits) is not None or _added_bias(logits)):
                return logits, c, name == "div"
    return None


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# A logit scale of at most 2**±16: a weight would then have to be below 2**-110 in magnitude to fall into
# fp32's or bf16's subnormals (2**-126) when scaled, and above 2**111 to overflow.
_MAX_SCALE_EXPONENT = 16


def _scale_factor(scale: tuple, logits: torch.fx.Node, variant: str) -> float:
    """The factor s of the logits' scale (c, or 1 / c when it divides) when it is ±2**k, else _Miss.

    The op takes the weight and bias scaled by s instead: ``x @ (s w).t() + s b``. Multiplying by a power of
    two only moves the exponent, so every product, partial sum and rounding of that GEMM is s times eager's
    (``s * (x @ w.t() + b)``), and so is the backward's: eager's gradient of x is ``(s g) @ w``, the op's
    ``g @ (s w)``, and autograd's gradient of ``s * w`` is s times the op's. That holds while the scaled
    weight stays in its dtype's normal range, which fp32 and bf16 keep for any weight of magnitude 2**-110 to
    2**111 with |k| <= 16 (_MAX_SCALE_EXPONENT). Any other factor rounds differently (a number times a weight
    rounded, then summed): not the same function, reported. Nor is a power of two in float16, whose
    subnormals start at 6e-5: a weight scaled below that (Cohere's 1 / 16 of a 1e-4 weight) loses bits that
    eager's scaled logits keep. A scale dynamo made a symbolic input (dynamic=True, a module's float
    attribute) is specialised."""
    c = _specialise({"scale": scale[0]}, "scale")
    if not _is_number(c) or c == 0 or not math.isfinite(c):
        raise _Miss(f"{variant}: the logits are scaled by {c!r}, not a finite nonzero number")
    factor = 1.0 / c if scale[1] else float(c)
    if not 2.0**-_MAX_SCALE_EXPONENT <= abs(factor) <= 2.0**_MAX_SCALE_EXPONENT:
        raise _Miss(f"{variant}: the logits are scaled by {factor!r}, beyond 2**±{_MAX_SCALE_EXPONENT}: the "
                    "weight scaled instead may leave the normal range of its dtype; not fused")
    if math.frexp(abs(c))[0] != 0.5:
        how = "divided" if scale[1] else "multiplied"
        raise _Miss(f"{variant}: the logits are {how} by {c!r}, not a power of two: the weight scaled "
                    "instead would round differently; not fused")
    dtype = getattr(tensor_meta(logits), "dtype", None)
    if dtype not in (torch.float32, torch.bfloat16) and factor != 1.0:
        raise _Miss(f"{variant}: {dtype} logits scaled by {factor!r}: the weight scaled instead may leave "
                    "float16's normal range; not fused")
    return factor


def _logits_source(ce_input: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node], bool, object,
                                                     object]:
    """(the F.linear node (or ``x @ w.t()``, _linear_operands), the chain between it and the cross-entropy,
    whether the chain upcasts, a bias added to the Linear's output in the chain or None, the scale of the
    logits (_head_scale: (c, whether it divides, the scaled logits' node)) or None)."""
    chain, upcast, node = [], False, ce_input
    while _linear_operands(node) is None:
        added = _added_bias(node)
        if added is not None:
            chain.append(node)
            return added[0], chain, upcast, added[1], None
        scaled = _head_scale(node)
        if scaled is not None:
            logits, c, divides = scaled
            chain.append(node)
            added = _added_bias(logits) if _linear_operands(logits) is None else None
            if added is not None:
                chain.append(logits)
                return added[0], chain, upcast, added[1], (c, divides, node)
            return logits, chain, upcast, None, (c, divides, node)
        if isinstance(node, torch.fx.Node) and node.op == "placeholder":
            raise _Miss(f"the logits ({node.name}) are an input of this graph (computed in another one, e.g. "
                        "before a graph break): there is no Linear here to fuse with")
        if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method") or \
                not node.args or not isinstance(node.args[0], torch.fx.Node):
            raise _Miss(f"the logits come from {getattr(node, 'name', node)}, not from an F.linear")
        name, source = op_name(node), node.args[0]
        if name in _RESHAPES and _is_reshape_keeping_classes(node, source):
            pass
        elif _row_selection(node) is not None:
            if is_op(source, "unbind"):  # logits.unbind(1)[2]: the item and the unbind are one selection
                chain.append(node)
                node, source = source, source.args[0]
        elif name in _CASTS and not upcast and _is_upcast(node, source):
            upcast = tensor_meta(source).dtype != torch.float32
        elif _row_permutation(node) is not None:
            pass  # the rows reordered, the classes left last: replayed on the rows' numbers (_row_steps)
        elif (permuted := _permutation(node)) is not None:
            raise _Miss(f"the logits pass through {_step_name(node)} ({node.name}), which permutes their "
                        f"dimensions by {tuple(permuted[1])}: it moves the class dimension from the last "
                        "(only permutations of the dimensions before it, which reorder the rows, are taken)")
        else:
            raise _Miss(f"the logits pass through {name or node.target} ({node.name}), which is not a "
                        "reshape keeping the class dimension last, a single cast up to fp32, a selection "
                        "of rows (an index or slice not along the class dimension) or a permutation of the "
                        "dimensions before the class one")
        chain.append(node)
        node = source
    return node, chain, upcast, None, None


# Between a log_softmax and the nll_loss that reads it: what makes the nll_loss a candidate (reported when
# it is not a reshape keeping the class dimension last).
_TAIL_STEPS = _RESHAPES | _CASTS | {"transpose", "permute", "movedim", "swapaxes", "swapdims", "t", "squeeze",
                                    "unsqueeze", "getitem", "narrow", "select", "unbind", "half", "bfloat16",
                                    "double"}


def _log_softmax_signature(input, dim=None, dtype=None, *, axis=None):
    """How torch.log_softmax, torch.special.log_softmax and Tensor.log_softmax (self first) bind: torch's
    argument parser takes NumPy's axis= for dim too (F.log_softmax, a Python function, does not)."""


def _log_softmax_tail(nll: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes from the nll_loss's input back to a log_softmax, latest first and the log_softmax last,
    when the input is a log_softmax seen through layout steps and casts; else None: the negative
    log-likelihood of log-probabilities computed some other way is not a cross-entropy candidate."""
    node, tail = arg(nll, 0, "input"), []
    while isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method"):
        tail.append(node)
        if is_op(node, "log_softmax"):  # F, torch, Tensor and torch.special (nn.LogSoftmax: F)
            return tail
        if op_name(node) not in _TAIL_STEPS and _permutation(node) is None or not node.args or \
                not isinstance(node.args[0], torch.fx.Node):  # (_permutation: ``.mT`` too)
            return None
        node = node.args[0]
    return None


def _log_softmax_input(log_softmax: torch.fx.Node, classes_at_dim_1: bool = False
                       ) -> tuple[torch.fx.Node, bool]:
    """(z, whether the log_softmax casts z up to fp32) when the log_softmax is z's over its last (the
    class) dimension, or over dim 1 where classes_at_dim_1 (z an (N, C, d1, ..) input of the nll_loss),
    computed in z's dtype or in fp32 (``dtype=torch.float32``: z cast up first, which is what
    F.cross_entropy(z.float()) computes); else _Miss with the reason."""
    signature = F.log_softmax if log_softmax.target is F.log_softmax else _log_softmax_signature
    args = bound_arguments(log_softmax, signature)
    if args is None or not isinstance(args["input"], torch.fx.Node):
        raise _Miss(f"cannot read the arguments of the log_softmax {log_softmax.name}")
    z, dim, dtype = args["input"], args["dim"], args["dtype"]
    if args.get("axis") is not None and dim is None:
        dim = args["axis"]
    meta = tensor_meta(z)
    if meta is None:
        raise _Miss(f"the input of the log_softmax {log_softmax.name} has no tensor metadata")
    if dim is None and log_softmax.target is F.log_softmax:
        dim = 0 if meta.dim() in (0, 1, 3) else 1  # F.log_softmax's deprecated implicit dim
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise _Miss(f"the log_softmax {log_softmax.name}'s dim={dim!r} is not a constant int")
    if classes_at_dim_1 and norm_dim(dim, meta.dim()) != 1:
        raise _Miss(f"the log_softmax {log_softmax.name} is over dim {dim} of its {meta.dim()}-D input, not "
                    "over the class dimension (1, where the nll_loss reads the classes of that input)")
    if not classes_at_dim_1 and not is_last_dim(dim, meta.dim()):
        raise _Miss(f"the log_softmax {log_softmax.name} is over dim {dim} of its {meta.dim()}-D input, not "
                    "over the class dimension (the last)")
    if dtype is None:
        return z, False
    if dtype is torch.float32 and _is_upcast(log_softmax, z):
        return z, meta.dtype != torch.float32
    raise _Miss(f"the log_softmax {log_softmax.name} with dtype={dtype} is not computed in the {meta.dtype} "
                "logits' dtype or in fp32")


def _rewrite_cross_entropy(graph: torch.fx.Graph, fn, ce: torch.fx.Node) -> None:
    args = _arguments(ce)
    _check_arguments(args)
    moved, logits, upcasts = _classes_moved_to_dim_1(args["input"])
    _rewrite_one(graph, fn, ce, args, logits, moved, upcasts, "F.cross_entropy",
                 class_move=moved[-1] if moved else None)


def _rewrite_nll_loss(graph: torch.fx.Graph, fn, nll: torch.fx.Node, tail: list[torch.fx.Node]) -> None:
    """F.nll_loss(F.log_softmax(z, -1), target, ...) is F.cross_entropy(z, target, ...) (ATen's
    cross_entropy computes exactly that for class-index targets without label smoothing) when the
    log-probabilities are not used otherwise and reach the nll_loss through row-regrouping reshapes only."""
    args = bound_arguments(nll, F.nll_loss)
    if args is None:
        raise _Miss("cannot read the arguments of F.nll_loss")
    args = {**args, "label_smoothing": 0.0}  # F.cross_entropy's default: nll_loss has none
    _check_arguments(args)
    # An (N, C, d1, ..) input, classes at dim 1: the log-probabilities of logits whose classes are last, moved
    # there after the log_softmax (``F.log_softmax(L, -1).transpose(1, 2)``: the steps up to that transpose
    # are moved), or the log_softmax over dim 1 of those logits moved first (``F.log_softmax(L.transpose(1,
    # 2), 1)``: softmax_at_dim_1, the steps before it then contiguous() alone)
    moved, softmax_at_dim_1 = [], False
    if tensor_meta(args["input"]).dim() > 2:
        if any(_permutation(step) is not None for step in tail[:-1]):
            moved = _classes_moved_to_dim_1(args["input"], casts=False)[0]
        else:
            softmax_at_dim_1 = True
    for reader, step in zip([nll, *tail][len(moved):], tail[len(moved):-1], strict=False):
        # a selection of rows commutes with the row-wise log_softmax: F.log_softmax(z, -1)[:, :-1] is
        # F.log_softmax(z[:, :-1], -1), a row selection of the logits (_row_steps); so does a permutation
        # of the rows
        if softmax_at_dim_1:
            if not (is_op(step, "contiguous") and _same_shape(step, step.args[0])):
                raise _Miss(f"the log-probabilities over dim 1 pass through {op_name(step) or step.target} "
                            f"({step.name}) between the log_softmax and the nll_loss: only contiguous() is "
                            "taken there")
        elif not (op_name(step) in _RESHAPES and _is_reshape_keeping_classes(step, step.args[0]) or
                  _row_selection(step) is not None or _row_permutation(step) is not None or
                  is_op(step, "unbind") and _row_selection(reader) is not None):
            raise _Miss(f"the log-probabilities pass through {op_name(step) or step.target} ({step.name}) "
                        "between the log_softmax and the nll_loss, which is not a reshape keeping the class "
                        "dimension last, a selection of rows or a permutation of the dimensions before the "
                        "class one")
    z, upcasts = _log_softmax_input(tail[-1], softmax_at_dim_1)
    before = []  # the transpose of the logits (and casts) before a log_softmax over dim 1
    if softmax_at_dim_1:
        before, z, moved_upcast = _classes_moved_to_dim_1(z)
        upcasts = upcasts or moved_upcast
    for node, reader in zip(tail, [nll, *tail], strict=False):
        # (a selection's row counts are redirected by _rewrite_one)
        sizes = _row_count_reads(node) if _row_selection(node) is not None else []
        others = [u.name for u in node.users if u is not reader and u not in sizes]
        if others:
            raise _Miss(f"the log-probabilities {node.name} are also used by {', '.join(others)}: the fused "
                        "op does not compute them")
    moved = moved or before  # the steps back to the class move, that permutation last
    _rewrite_one(graph, fn, nll, args, z, [*tail, *before], upcasts, "F.nll_loss",
                 class_move=moved[-1] if moved else None)


def _same_shape(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    ta, tb = tensor_meta(a), tensor_meta(b)
    return ta is not None and tb is not None and ta.dim() == tb.dim() and \
        all(statically_known_true(m == n) for m, n in zip(ta.shape, tb.shape, strict=True))


def _row_steps(chain: list[torch.fx.Node], class_move: torch.fx.Node | None = None) -> list[torch.fx.Node]:
    """The steps of the chain that select rows (``logits[..., :-1, :]``, _row_selection) or reorder them
    (``logits.transpose(0, 1)`` of sequence-first logits, _row_permutation), the Linear's side first; _Miss
    when one follows a reshape that regroups the rows: its index or permutation then means rows of another
    shape than the one _target_of_every_row replays it on. (A regrouping reshape after the last of them,
    the final ``view(-1, V)``, is row-major: it keeps the order of the rows, which is all the loss sees.)
    class_move: the chain's permutation moving the classes to dim 1 (_classes_moved_to_dim_1), a step when
    it also permutes the rows (``permute(1, 2, 0)``; _row_permutation with class_move)."""
    steps, regrouped = [], None
    for step in reversed(chain):  # the chain is latest first
        if step is class_move:
            q = _row_permutation(step, class_move=True)
            selects, permutes = False, q != sorted(q)
        else:
            selects, permutes = _row_selection(step) is not None, _row_permutation(step) is not None
        if selects or permutes:
            if regrouped is not None:
                what = "indexed" if selects else f"permuted by {_step_name(step)}"
                raise _Miss(f"the logits are {what} ({step.name}) after {regrouped.name} regrouped their "
                            "rows")
            steps.append(step)
        elif op_name(step) in _RESHAPES and not _same_shape(step, step.args[0]):
            regrouped = step
    return steps


def _target_of_every_row(graph: torch.fx.Graph, x: torch.fx.Node, slices: list[torch.fx.Node],
                         target: torch.fx.Node, ignore_index: int, like: torch.fx.Node,
                         inserted: list[torch.fx.Node], class_move: torch.fx.Node | None = None
                         ) -> tuple[torch.fx.Node, torch.fx.Node, dict]:
    """(a target for every row of x, the positions of the selected rows among them, for each selection the
    row numbers it selects), inserted into the graph.

    The causal-LM shift, ``F.cross_entropy(logits[..., :-1, :]..., labels[..., 1:]...)``, is the loss over
    every row of the logits with the dropped rows' targets set to ignore_index: an ignored row adds 0 to
    the loss and its gradient, and is not counted by reduction='mean'. The op then computes the logits of
    every row, which it returns as it does without the slice, so the full logits' other users (a model
    returning ``.logits``) keep reading them, and one GEMM computes both. (Slicing x instead would leave
    no full logits for them, and computing them again costs the head's GEMM twice.) The positions are those
    of the selected rows in row-major order: the same index applied to a grid of row numbers, flattened as
    the loss's (M, V) input is.

    A permutation of the rows (_row_permutation: sequence-first logits transposed to batch-first, ChatGLM's
    ``lm_logits.transpose(0, 1).contiguous()``) is replayed on the grid as well, in its place among the
    selections: the grid then holds, for each row the loss reads, the number of the Linear's row it is, so
    the scatter pairs every Linear row with its own target, and the op's per-row loss read at the positions
    is eager's, in eager's order. The op still computes (and returns) the logits in the Linear's layout; the
    permutation's node, where the model also returns the permuted logits, reads them. So is the row
    permutation of the class move class_move (``permute(1, 2, 0)`` of (S, B, V) logits: (1, 0); the rows are
    then read in the (B, S) target's row-major order), the last of the steps."""
    def call(fn, *a, **k):
        node = insert_call(graph, fn, a, k, like=like)
        inserted.append(node)
        return node

    lead = call(torch.select, x, -1, 0)  # x's leading shape, whatever its size symbols
    ones = call(torch.ones_like, lead, dtype=torch.int64, memory_format=torch.contiguous_format)
    flat = call(torch.reshape, ones, (-1,))
    grid = call(torch.Tensor.view_as, call(torch.sub, call(torch.cumsum, flat, 0), 1), lead)
    grids = {}
    for step in slices:
        permutation = _row_permutation(step, class_move=step is class_move)
        select, arguments = (torch.permute, (permutation,)) if permutation is not None else \
            _row_selection(step)
        grid = grids[step] = call(select, grid, *arguments)
    positions = call(torch.reshape, grid, (-1,))
    # (no example value, the op's fake run below fails and reports it, erasing these)
    target = call(torch.scatter, call(torch.full_like, flat, ignore_index), 0, positions, target)
    return target, positions, grids


def _row_count_reads(step: torch.fx.Node) -> list[torch.fx.Node]:
    """The users of a row selection that read one of its row dimensions' sizes only, ``sym_size(step, d)``:
    dynamo adds them for a mask's data-dependent row count (its range assertions). The row numbers the
    selection picks (_target_of_every_row's grid) have the same leading sizes, so they can read those
    instead, and the selected logits need not be kept for them."""
    out = tensor_meta(step)
    return [u for u in step.users if out is not None and u.op == "call_function" and
            u.target is torch.ops.aten.sym_size.int and len(u.args) == 2 and u.args[0] is step and
            isinstance(u.args[1], int) and 0 <= u.args[1] % max(out.dim(), 1) < out.dim() - 1]


def _computed_from(node: object, source: torch.fx.Node) -> bool:
    """Whether node's value is computed from source's (source among its ancestors)."""
    if not isinstance(node, torch.fx.Node):
        return False
    order = {n: i for i, n in enumerate(source.graph.nodes)}
    pending, seen = [node], set()
    while pending:
        n = pending.pop()
        if n is source:
            return True
        if n in seen or order[n] < order[source]:  # computed before source: not from it
            continue
        seen.add(n)
        pending.extend(n.all_input_nodes)
    return False


def _step_name(node: torch.fx.Node) -> str:
    """What a step of the chain is called in the report: its op, or the attribute read (``.mT``)."""
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2:
        return str(node.args[1])
    return op_name(node) or str(node.target)


def _slower_than_unfused(*inputs) -> bool:
    metas = [tensor_meta(t) for t in inputs if t is not None]
    on_cuda = any(m is not None and m.device.type == "cuda" for m in metas)
    return on_cuda and not flash_config.cross_entropy_on_cuda


def _rewrite_one(graph: torch.fx.Graph, fn, ce: torch.fx.Node, args: dict, logits_input: torch.fx.Node,
                 tail: list[torch.fx.Node], tail_upcasts: bool, loss_name: str,
                 class_move: torch.fx.Node | None = None) -> None:
    """Rewrite the loss ce, whose cross-entropy arguments (checked) are args and whose logits logits_input
    are (through the chain _logits_source walks) those of an F.linear. tail: the nodes between
    logits_input and ce, latest first (for F.cross_entropy the transpose moving the classes to dim 1 and
    what follows it, or nothing; for F.nll_loss also the log_softmax and the reshapes after it), already
    proven to compute nothing else; tail_upcasts: whether they cast up. class_move: ce's input is
    (N, C, d1, ..), the logits' classes moved to dim 1 by class_move, a permutation in tail
    (_classes_moved_to_dim_1), and its target (N, d1, ..): the op gets the target flattened, and eager's
    per-row loss (reduction='none') has the target's shape."""
    classes_moved = class_move is not None
    linear, chain, upcast, added_bias, scale = _logits_source(logits_input)
    chain, upcast = [*tail, *chain], upcast or tail_upcasts
    slices = _row_steps(chain, class_move)
    x, weight, bias, transposed = _linear_operands(linear)
    # The logits the op returns: the Linear's, or those with the added class bias (then the add's node), or
    # those scaled (then the scale's node)
    logits_node = scale[2] if scale is not None else chain[-1] if added_bias is not None else linear
    head = {"linear": "F.linear", "addmm": "addmm(b, x, w.t())", "einsum": "einsum"}.get(op_name(linear),
                                                                                        "x @ w.t()")
    variant = " -> ".join([head, *(_step_name(n) for n in reversed(chain)), loss_name])
    # Autocast: the Linear computes in a lower dtype than its operands, which it casts, its own bias
    # included, and rounds the logits to that dtype; F.cross_entropy (autocast's fp32 list) then takes them in
    # fp32. The op computes its logits in its inputs' dtype and the loss from them in fp32, so with the
    # operands cast the same way, in the graph, it is eager's function, and autograd takes each cast's
    # gradient back to the operand's own dtype (fx_passes/dense.py does the same; review s35b M1). A class
    # bias added after the Linear is not cast (a bias of another dtype changes the logits' dtype, which the
    # check of the op's outputs below refuses).
    compute = getattr(tensor_meta(linear), "dtype", None)
    autocast = [n for n in (x, weight, bias if added_bias is None else None)
                if isinstance(n, torch.fx.Node) and compute is not None
                and getattr(tensor_meta(n), "dtype", compute) != compute]
    if autocast:
        variant = f"{variant} (autocast to {str(compute).removeprefix('torch.')})"
    writer = out_writer([linear, *chain, ce])
    if writer is not None:
        raise _Miss(f"{variant}: {writer.name} also writes its result into out=, which the fused op would "
                    "not")
    written = written_before_end({linear, *chain, ce}, ce)
    if written is not None:
        node, writer = written
        raise _Miss(f"{variant}: {node.name} is written in place by {writer.name} before the loss reads "
                    "it; the fused op, placed after its inputs, would not see the write")
    # The logits themselves, through any view of them, the chain's own included (which written_before_end
    # does not walk into: ``flat = logits.view(-1, V); flat.mul_(2)`` before the loss changes what it reads,
    # which the op, computing the logits itself, would not see). After the loss too: the op keeps the
    # logits it returns for its backward where eager's loss keeps its log-probabilities, so a write after
    # it (``logits.div_(T)``) fails the backward that eager's runs.
    writers = in_place_writers(logits_node)
    if writers:
        raise _Miss(f"{variant}: the logits {logits_node.name} are written in place by {writers[0].name}: "
                    "the fused op would compute the loss from them unwritten and keep them for its backward "
                    "(eager's loss keeps its log-probabilities)")
    kept = linear_operand_writer(x, weight, {linear, *chain, ce}, ce, copied=autocast)
    if kept is not None:  # after the loss (before it: written_before_end)
        what, operand, writer = kept
        raise _Miss(f"{variant}: the head's {what} {operand.name} is written in place by {writer.name} after "
                    "the loss: the fused op keeps it for its backward, which would then fail where eager's "
                    "(the other operand needs no gradient: the matmul keeps only that one) does not")
    if _computed_from(args["target"], linear):
        # pseudo-labels, ``F.cross_entropy(logits, logits.argmax(-1))``: the op, which computes the logits,
        # would need its target before it runs
        raise _Miss(f"{variant}: the target {args['target'].name} is computed from the logits")
    for step in slices:  # likewise what selects the rows, which builds the op's target (a mask, a size)
        chosen_by = [n for n in step.all_input_nodes if n is not step.args[0] and _computed_from(n, linear)]
        if chosen_by:
            raise _Miss(f"{variant}: the rows {step.name} selects are chosen by {chosen_by[0].name}, "
                        "computed from the logits")
    if _slower_than_unfused(x, weight, bias):
        raise _Miss(f"{variant}: on CUDA with flash_backend.config.cross_entropy_on_cuda off")
    logits_meta = tensor_meta(linear)
    if logits_meta is not None and logits_meta.dtype not in (*_LOW_PRECISION, torch.float32):
        # fp64 logits: the op computes the loss and its gradient in fp32, eager in fp64 (a 1e-7 error in an
        # fp64 result)
        raise _Miss(f"{variant}: the logits are {logits_meta.dtype}; the fused op computes the loss in fp32, "
                    "eager in that dtype")
    want_loss, want_logits = tensor_meta(ce), tensor_meta(logits_node)
    ignore_index, smoothing = _specialise(args, "ignore_index"), _specialise(args, "label_smoothing")
    if not 0.0 <= smoothing <= 1.0:
        raise _Miss(f"label_smoothing={smoothing!r} is not in [0, 1]")
    kwargs = {"ignore_index": ignore_index, "reduction": args["reduction"],
              "label_smoothing": float(smoothing),
              "loss_dtype": want_loss.dtype if want_loss is not None else None}
    inserted, target, positions, grids = [], args["target"], None, {}
    cast = {n: insert_call(graph, torch.Tensor.to, (n, compute), like=linear) for n in autocast}
    inserted += cast.values()
    x, weight = cast.get(x, x), cast.get(weight, weight)
    bias = cast.get(bias, bias) if bias is not None else None
    factor = _scale_factor(scale, linear, variant) if scale is not None else 1.0
    if added_bias is not None:
        bias = added_bias
    if bias is not None and tensor_meta(bias) is not None and tensor_meta(bias).dim() != 1:
        # an added class bias or addmm's, (1, .., 1, V) -> (V,): the op's bias
        bias = insert_call(graph, torch.reshape, (bias, (-1,)), like=logits_node)
        inserted.append(bias)
    if scale is not None:  # s * (x @ w.t() + b) is x @ (s w).t() + s b, s a power of two (_scale_factor)
        weight = insert_call(graph, torch.mul, (weight, factor), like=logits_node)
        inserted.append(weight)
        if bias is not None:
            bias = insert_call(graph, torch.mul, (bias, factor), like=logits_node)
            inserted.append(bias)
    if classes_moved:  # (N, d1, ..) -> (M,), row-major: the logits' row order (_classes_moved_to_dim_1)
        target = insert_call(graph, torch.reshape, (target, (-1,)), like=ce)
        inserted.append(target)
    if slices:
        target, positions, grids = _target_of_every_row(graph, x, slices, target, ignore_index, ce, inserted,
                                                        class_move)
    op_args = (x, weight, bias, target)
    # The op's per-row loss (reduction='none') covers every row of x, flat; eager's the selected ones, shaped
    # as the target
    per_row = args["reduction"] == "none"
    want_rows = val(target) if per_row and (positions is not None or classes_moved) else want_loss
    if per_row and classes_moved and not _same_shape(ce, args["target"]):
        erase_unused(graph, inserted)
        raise _Miss(f"{variant}: eager's per-row loss is not shaped as the target")
    try:
        try:
            result = fake_call(fn, op_args, kwargs)
        except Exception as e:  # noqa: BLE001 - the op's own input checks say what it cannot take
            reason = str(e).splitlines()[0][:200]
            raise _Miss(f"{variant}: the fused op does not take these inputs: {reason}") from None
        if not isinstance(result, tuple) or want_loss is None or want_logits is None or \
                want_rows is None or result[0].dtype != want_loss.dtype or \
                tuple(result[0].shape) != tuple(want_rows.shape) or \
                (result[1].dtype, tuple(result[1].shape)) != (want_logits.dtype, tuple(want_logits.shape)):
            raise _Miss(f"{variant}: the fused op's (loss, logits) would differ in dtype or shape from "
                        "eager's")
    except _Miss:
        erase_unused(graph, inserted)
        raise

    crossing = state_crossing([logits_node, ce])
    if crossing:
        erase_unused(graph, inserted)
        raise _Miss(f"{variant}: {crossing}")
    fused = insert_call(graph, fn, op_args, kwargs, like=ce)
    loss, logits = insert_getitem(graph, fused, 0), insert_getitem(graph, fused, 1)
    if positions is not None and per_row:  # back to the selected rows, in their order
        loss = insert_call(graph, torch.index_select, (loss, 0, positions), like=ce)
    if classes_moved and per_row:  # (M,) -> (N, d1, ..)
        loss = insert_call(graph, torch.Tensor.reshape_as, (loss, args["target"]), like=ce)
    ce.replace_all_uses_with(loss)
    for step, grid in grids.items():
        for size in _row_count_reads(step):
            size.replace_input_with(step, grid)
    logits_node.replace_all_uses_with(logits)
    record_rewrite(FAMILY, variant + (" (logits upcast to fp32)" if upcast else ""), _OP_NAME, ce)
    erase_unused(graph, [ce, *chain, linear, *filter(None, [transposed])])


def _unary_input(node: object, name: str) -> torch.fx.Node | None:
    """x of ``-x`` / ``torch.neg(x)`` / ``x.neg()`` (name 'neg'), else None."""
    if not is_op(node, name) or len(node.args) != 1 or node.kwargs:
        return None
    return node.args[0] if isinstance(node.args[0], torch.fx.Node) else None


def _dim_one_of_2d(node: torch.fx.Node, name: str) -> torch.fx.Node | None:
    """x of ``x.squeeze(1)`` / ``x.unsqueeze(1)`` (or dim -1) for name, x a 2-D (squeeze) or 1-D (unsqueeze)
    tensor: its column dimension; else None."""
    if not is_op(node, name) or set(node.kwargs) - {"dim"}:
        return None
    x, dim = arg(node, 0, "input"), arg(node, 1, "dim")
    meta = tensor_meta(x) if isinstance(x, torch.fx.Node) else None
    rank = 2 if name == "squeeze" else 1
    return x if meta is not None and meta.dim() == rank and dim in (1, -1) else None


def _coefficient(c: object) -> tuple[float, set] | None:
    """(value, the float-input symbols it is computed from) of a Python number, or of a SymFloat node that
    dynamic=True made of a module's float attribute (timm's ``self.confidence``), which the rewrite then
    specialises (rewrite()); else None."""
    if is_number(c):
        return float(c), set()
    symbols = float_input_symbols(val(c)) if isinstance(c, torch.fx.Node) else None
    return (float(val(c)), symbols) if symbols else None


def _scaled_term(node: object) -> tuple[float, set, torch.fx.Node] | None:
    """(c, its symbols, t) of ``c * t`` / ``t * c`` with c a number (_coefficient), t read by that product
    only."""
    pair = binary_operands(node, "mul")
    if pair is None:
        return None
    for c, t in (pair, pair[::-1]):
        coefficient = _coefficient(c)
        if coefficient is not None and isinstance(t, torch.fx.Node) and len(t.users) == 1 and \
                isinstance(val(t), torch.Tensor):
            return *coefficient, t
    return None


def _hand_written_label_smoothing(root: torch.fx.Node) -> tuple | None:
    """(lp, target, s, nodes, symbols) when root is timm's LabelSmoothingCrossEntropy written out (and any
    code spelled so): ``((1 - s) * nll + s * smooth).mean()`` with ``nll = -lp.gather(-1, y.unsqueeze(1))
    .squeeze(1)`` (the negation before or after the squeeze), ``smooth = -lp.mean(-1)``, lp a log_softmax
    read by those two only, y (M,) int64; nodes: root, what it computes from lp and y.unsqueeze(1), lp last;
    symbols: the float inputs the coefficients are (_coefficient). Else None.

    Per row that is (1 - s) * -lp[y] + s * mean_c(-lp[c]), averaged over the rows: exactly
    F.cross_entropy(z, y, label_smoothing=s) (its loss puts 1 - s on the target and s / C on every class),
    for every y eager's gather accepts (in [0, C); -100 eager rejects, cross_entropy would ignore). The
    coefficients must sum to 1 (to rounding): fairseq's label_smoothed_nll_loss spreads s over the C - 1
    other classes, ``(1 - s - s / (C - 1)) * nll + s / (C - 1) * lp.sum(-1)``, another function, and sums
    before it combines: not this form."""
    if not is_op(root, "mean") or len(root.args) != 1 or root.kwargs or \
            not isinstance(root.args[0], torch.fx.Node):
        return None
    total = root.args[0]
    pair = binary_operands(total, "add")
    if pair is None or len(total.users) != 1:
        return None
    terms = [_scaled_term(t) for t in pair]
    if None in terms:
        return None
    nodes, found, symbols = [root, total, *pair], {}, set()
    for c, term_symbols, t in terms:
        symbols |= term_symbols
        inner = _unary_input(t, "neg")
        if inner is not None and is_op(inner, "mean") and len(inner.users) == 1:  # the smoothing term
            lp, dim = arg(inner, 0, "input"), arg(inner, 1, "dim")
            keepdim = arg(inner, 2, "keepdim", False)
            if set(inner.kwargs) - {"dim", "keepdim"} or keepdim or not isinstance(lp, torch.fx.Node):
                return None
            meta = tensor_meta(lp)
            if meta is None or meta.dim() != 2 or dim not in (-1, 1, [-1], [1], (-1,), (1,)):
                return None
            found["smooth"] = (c, lp)
            nodes += [t, inner]
            continue
        # the target's term: neg(squeeze(gather)) or squeeze(neg(gather))
        chain = [t]
        node = inner if inner is not None else _dim_one_of_2d(t, "squeeze")
        if node is None or len(node.users) != 1:
            return None
        chain.append(node)
        node = _dim_one_of_2d(node, "squeeze") if inner is not None else _unary_input(node, "neg")
        if node is None or len(node.users) != 1 or not is_op(node, "gather") or \
                set(node.kwargs) - {"dim", "index", "sparse_grad"} or arg(node, 3, "sparse_grad", False):
            return None
        chain.append(node)
        lp, dim, index = arg(node, 0, "input"), arg(node, 1, "dim"), arg(node, 2, "index")
        y = _dim_one_of_2d(index, "unsqueeze") if isinstance(index, torch.fx.Node) else None
        if dim not in (-1, 1) or y is None or not isinstance(lp, torch.fx.Node):
            return None
        found["nll"] = (c, lp, y)
        nodes += [*chain, index]
    if set(found) != {"nll", "smooth"} or found["nll"][1] is not found["smooth"][1]:
        return None
    (confidence, lp, y), (smoothing, _) = found["nll"], found["smooth"]
    target = tensor_meta(y)
    if not is_op(lp, "log_softmax") or len(lp.users) != 2 or target is None or target.dim() != 1 or \
            target.dtype != torch.int64 or not 0.0 <= smoothing <= 1.0 or \
            abs(confidence + smoothing - 1) > 1e-12:
        return None
    return lp, y, smoothing, [*nodes, lp], symbols


def _rewrite_hand_written_label_smoothing(graph: torch.fx.Graph, fn, root: torch.fx.Node,
                                          lp: torch.fx.Node, y: torch.fx.Node, smoothing: float,
                                          nodes: list[torch.fx.Node], symbols: set) -> None:
    """Replace root (_hand_written_label_smoothing) by F.cross_entropy(z, y, label_smoothing=s), z the
    log_softmax's input, and rewrite that as any other; on a _Miss (z is no Linear's, ...) eager's nodes are
    put back as they were, and it is reported."""
    z, upcasts = _log_softmax_input(lp)
    if upcasts:
        raise _Miss(f"the log_softmax {lp.name} casts its input up to fp32 (dtype=)")
    ce = insert_call(graph, F.cross_entropy, (z, y), {"label_smoothing": smoothing}, like=root)
    root.replace_all_uses_with(ce)
    try:
        args = _arguments(ce)
        _check_arguments(args)
        _rewrite_one(graph, fn, ce, args, z, [], False, "(1 - s) * nll + s * smooth by hand")
    except Exception:
        if not getattr(ce, "_erased", False):
            ce.replace_all_uses_with(root)
            graph.erase_node(ce)
        raise
    erase_unused(graph, nodes)
    _float_inputs_to_specialise.extend(symbols)


def rewrite(graph: torch.fx.Graph) -> None:
    fn = _fused_op()
    if fn is None:
        return
    _float_inputs_to_specialise.clear()
    losses = [n for n in graph.nodes if n.op == "call_function" and
              (n.target is F.cross_entropy or n.target is F.nll_loss)]
    for loss in losses:
        if loss.target is F.cross_entropy:
            candidate, tail = "Linear + cross-entropy", None
        else:
            tail = _log_softmax_tail(loss)
            if tail is None:
                continue  # the negative log-likelihood of log-probabilities from elsewhere: not a candidate
            candidate = "Linear + log_softmax + nll_loss"
        try:
            if tail is None:
                _rewrite_cross_entropy(graph, fn, loss)
            else:
                _rewrite_nll_loss(graph, fn, loss, tail)
        except _Miss as miss:
            record_near_miss(FAMILY, candidate, str(miss), loss)
        except Exception as error:  # noqa: BLE001 - a matcher bug must cost a fusion, never the compile
            record_near_miss(FAMILY, candidate, f"internal error {type(error).__name__}: {error}", loss)
    candidate = "Linear + label smoothing by hand"
    for root in [n for n in graph.nodes if is_op(n, "mean")]:
        if getattr(root, "_erased", False):  # by an earlier rewrite
            continue
        found = _hand_written_label_smoothing(root)
        if found is None:
            continue
        try:
            _rewrite_hand_written_label_smoothing(graph, fn, root, *found)
        except _Miss as miss:
            record_near_miss(FAMILY, candidate, str(miss), root)
        except Exception as error:  # noqa: BLE001 - a matcher bug must cost a fusion, never the compile
            record_near_miss(FAMILY, candidate, f"internal error {type(error).__name__}: {error}", root)
    if _float_inputs_to_specialise:
        # dynamic=True made a module float (label_smoothing) a graph input and a rewrite baked its value in:
        # restart dynamo's analysis with it a constant, as the norm pass does (Inductor would anyway). The
        # decisions of this run are not counted (fx_passes/_report.py: committed_only).
        # Dynamo throws this graph away on the restart, erasing it last node first, which fails on a node
        # still read by one placed before it: the op calls this pass and those before it inserted after
        # their inputs, ahead of run_passes' final sort (review s32: Phi-1.5 under dynamic=True crashed).
        stable_topological_sort(graph)
        restart_with_specialised_floats(_float_inputs_to_specialise)
