"""Attention family: softmax(q kᵀ · scale + mask) · v, written by hand or as F.scaled_dot_product_attention,
becomes ``flash_backend.ops.attention.flash_attention`` (one ``torch.ops.flash.attention_forward``).

Why: eager attention materialises the (B, H, Sq, Sk) scores and probabilities in HBM, several times in
training; the flash op never does, and its registered autograd gives the backward for free because this
pass runs on the Torch IR, before AOTAutograd.

Trade-off: the matcher is a structural walk rather than traced ``register_replacement`` patterns. Real
code spells attention in too many equivalent ways (matmul / @ / bmm / einsum; scale on q, on k or on the
scores, by a number or a sqrt tensor; masks added, filled or selected, in either operand order; casts and
dropout anywhere on the probabilities; repeat_kv for GQA; einsum k and v with no head subscript for
multi-query, "bhid,bjd->bhij") for a table of traced patterns to cover their product. The walk starts at
every softmax (also written out, as exp / sum or exp · (1 / sum), as exp(log_softmax) or as
exp(s - logsumexp(s))) and every SDPA call, follows the chain down to q·kᵀ and up to ·v, and rewrites only
when each step is proven equivalent:
softmax over the last dim, kᵀ a transpose of k's last two dims, a constant positive scale, masks whose
broadcast fits the scores (an integer one converted to the scores' dtype, as eager promotes it), no cast
to a lower precision, no other user of any intermediate, constant dropout settings. A clamp of the scores
from below at the dtype's finfo.min or -inf (XGLM's and old BART / OPT's overflow guard ``torch.max(s,
finfo.min)``) is the identity on finite scores and is seen through (_score_clamp). Anything else is a
near miss, reported with its reason; so is a softmax over the scores concatenated with other columns along
the key dim (GPT-OSS's attention sinks, _concatenated_scores), which is no attention the op computes.
Old GPT-2's ``w * b - 1e4 * (1 - b)`` is a mask when b provably holds 0 and 1 only (_multiplicative_keep).
k / v repeated to q's heads (repeat_kv, litgpt's expand + reshape, repeat_interleave) reach the op
un-repeated, also before an SDPA call (_unrepeat).
Masks built from constants only (tril/triu, arange comparisons) are evaluated at compile time: a causal one
(an additive value at or below -1e4 counting as masked, as a filled one does: flash-attn's ``s +
triu(full((S, S), -10000), 1)``, _Masks.constant_keep) becomes ``is_causal=True`` (bottom-right aligned,
FlashAttention's ``causal_alignment="bottom_right"``, for the band of KV-cache decoding with Sq < Sk) and
an all-visible one disappears. So are masks built by statements (in-place writes, also through views or
in-place results, when every read comes after them) and from a template read for its shape only
(``q.new_ones(S, S).tril()``) or cast with one (``m.type_as(q)``, ``m.to(q)``: Meta's Llama reference); a
graph input (a registered buffer) never is. A mask factor provably all True at any size (transformers'
and_mask starts from ``q_idx.new_ones((), dtype=torch.bool)``, symbolic under dynamic shapes) masks nothing
and is dropped (_constant_truth). q and k cast up to fp32 for the scores of half-precision attention
(GPT-J), with the probabilities cast back to v's dtype, are taken before their casts (_strip_score_upcasts).

Under autocast (around the compiled call or a region inside it) q·kᵀ, ·v and SDPA compute in the autocast
dtype from fp32 (or mixed) operands, which they cast: the op gets q, k, v (and SDPA's float attn_mask,
baddbmm's bias) cast the same way in the graph (_autocast_dtype), and returns eager's dtype.

The walk also sees through views / reshapes of the scores and probabilities that split or merge their
leading (batch, head) dims and keep the last two: bmm on (B·H, S, D) viewed to (B, H, S, S) for the mask
and back (BART / fairseq / CLIP before the attention interface, Bloom, GPT-NeoX's ``baddbmm(...).view``),
4-d scores merged to (B·H, S, S) for the softmax, Swin's 5-d per-window mask view. The op then runs in
the first 4-d layout seen, with q, k, v and masks reshaped into it. A reshape that touches the last two
dims is a near miss, but for a split of the query and of the key dim into factors with only bias terms added
before the merge back (SAM / ViTDet's decomposed relative positions, ``(s.view(B, q_h, q_w, k_h, k_w) +
rel_h[..., None] + rel_w[..., None, :]).view(B, q_h·q_w, k_h·k_w)``): the terms' sum, merged to
(.., Sq, Sk), is an additive mask (_split_score_bias). q·kᵀ over more than two batch dims (Hiera's (B,
heads, windows, S, D) mask units) runs as (B, heads·windows, S, D) (_Layout._merge). In-place updates of
fresh tensors (``scores.masked_fill_``, ``scores += mask``, ``q *= scaling``) are made functional first when
that keeps their dtype.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator

import torch
import torch.fx
from torch.fx import Graph, Node

from flash_backend import config as flash_config
from fx_passes._compat import float_input_symbols, restart_with_specialised_floats, stable_topological_sort
from fx_passes._functionalize import IN_PLACE_OPERATORS, functionalize_in_place
from fx_passes._match import (
    _is_alias_of_arg0,
    arg,
    binary_operands,
    bound_arguments,
    in_place_writers,
    insert_call,
    is_in_place,
    is_number,
    norm_dim,
    op_name,
    out_writer,
    records_grad,
    state_crossing,
    state_regions,
    storage_family,
    tensor_meta,
    val,
)
from fx_passes._match import binary_extra_kwargs as _extra_kwargs
from fx_passes._match import binary_operand_pair as _operands
from fx_passes._report import record_near_miss, record_rewrite

log = logging.getLogger("flash_backend")

FAMILY = "attention"
ORDER = 10  # before families that might claim the matmuls or the dropout around attention

_MATMULS = ("matmul", "bmm", "einsum")
# q·kᵀ may also come from baddbmm (beta·input + alpha·q@kᵀ: GPT-NeoX, Bloom's alibi); never ·v.
_SCORE_MATMULS = _MATMULS + ("baddbmm",)
_CASTS = ("to", "type", "float", "half", "bfloat16", "double", "type_as")
_IDENTITY = ("contiguous", "clone")
# Row-major reshapes. The walk sees through one only when it splits or merges the leading (batch, head)
# dims of the scores or probabilities and keeps the last two (query, key): the function is then the same
# on the flat (batch·head) index, and q, k, v and the masks are brought to one layout for the op.
_RESHAPES = ("view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze")
# Filled values at or below this count as "masked out": exp(fill - max) underflows to exactly 0.
_MASKED_VALUE = -1e4
# Additive mask values at or below this are masked out whatever the scores are (|s| << 1e30).
_ADDITIVE_MASKED = -1e30
_CONST_EVAL_MAX_NUMEL = 1 << 24
_RANDOM_OPS = (
    "rand",
    "randn",
    "randint",
    "randperm",
    "bernoulli",
    "normal",
    "uniform",
    "multinomial",
    "dropout",
    "empty",
    "empty_like",
    "new_empty",
    "exponential",
    "poisson",
)


class _Skip(Exception):
    """A candidate that is not (provably) attention; the message is the reason reported."""


# --------------------------------------------------------------------------------------------------------
# Node helpers
# --------------------------------------------------------------------------------------------------------


def _shape(node) -> tuple | None:
    t = tensor_meta(node)
    return tuple(t.shape) if t is not None else None


def _dtype(node):
    t = tensor_meta(node)
    return t.dtype if t is not None else None


def _single_user(node: Node, user: Node) -> bool:
    return set(node.users) == {user}


def _where_operands(node) -> tuple | None:
    """(condition, input, other) of ``torch.where(cond, a, b)`` (by position or keyword) or of the method
    ``a.where(cond, b)``, which is where(cond, a, b): self is the value kept where cond holds, not the
    condition. None for anything else (torch.where(cond) alone returns indices)."""
    if not isinstance(node, Node) or op_name(node) != "where":
        return None
    if node.op == "call_method":
        values = (arg(node, 1, "condition"), node.args[0] if node.args else None, arg(node, 2, "other"))
    else:
        values = (arg(node, 0, "condition"), arg(node, 1, "input"), arg(node, 2, "other"))
    if any(v is None for v in values) or len(node.args) + len(node.kwargs) != 3:
        return None
    return values


def _is_static(t) -> bool:
    return isinstance(t, torch.Tensor) and all(isinstance(s, int) for s in t.shape)


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _backed_hints(shape_env) -> dict:
    """{symbol: example value} of a ShapeEnv (torch 2.13 renamed var_to_val to backed_var_to_val)."""
    hints = getattr(shape_env, "backed_var_to_val", None)
    return shape_env.var_to_val if hints is None else hints


def _hint(value, sizes: dict | None = None):
    """A symbolic scalar's value for the example inputs the graph was traced with (a plain number as is),
    or with the size symbols in `sizes` ({sympy symbol: int}) at those values instead."""
    if not isinstance(value, _SYMBOLIC):
        return value
    if sizes:
        expr, env = value.node.expr, value.node.shape_env
        hints = _backed_hints(env)
        subs = {sym: sizes.get(sym, hints.get(sym)) for sym in expr.free_symbols}
        if all(v is not None for v in subs.values()):
            result = expr.xreplace(subs)
            if isinstance(value, torch.SymBool):
                return bool(result)
            return int(result) if isinstance(value, torch.SymInt) else float(result)
    hint = getattr(value.node, "hint", None)
    if not is_number(hint):
        raise _Skip("symbolic value without a hint")
    return hint


def _const_eval(node, memo: dict | None = None, hints: bool | dict = False):
    """The concrete value of a subgraph that reads no input (factories, constants, shapes), or raise.

    Nondeterministic factories are refused: a random mask evaluated once proves nothing. hints=True
    evaluates it with each symbolic scalar (a size under dynamic shapes, a float input) at its example
    value: a result that holds for those values only, for checks that refuse a rewrite, never for ones that
    allow it. hints={symbol: int} evaluates it with those size symbols at those values (_hint's sizes).

    A tensor written in place (itself, through a view of it, or through the result of an in-place call on
    it) is evaluated with its writes when every read of it comes after all of them (_eval_written). A
    factory that takes a tensor as a template for shape, dtype and device only (``q.new_ones(S, S)``,
    ``torch.zeros_like(m)``) is a constant: the template's values are never read.
    """
    sizes = hints if isinstance(hints, dict) else None
    memo = {} if memo is None else memo
    if not isinstance(node, Node):
        if isinstance(node, _SYMBOLIC):
            if hints:
                return _hint(node, sizes)
            raise _Skip("symbolic value")
        return node
    if node in memo:
        return memo[node]
    meta = val(node)
    if hints and isinstance(meta, _SYMBOLIC):  # a size under dynamic shapes, a graph input or not
        return _hint(meta, sizes)
    if node.op not in ("call_function", "call_method"):
        raise _Skip("reads a graph input")
    if _nondeterministic(node):
        raise _Skip("nondeterministic")
    base, members, writers = storage_family(node)
    if writers:
        _eval_written(base, members, writers, memo, hints)
        return memo[node]
    _check_evaluable(node, hints, sizes)
    result = _call_real(node, _real_args(node, memo, hints))
    memo[node] = result
    return result


def _nondeterministic(node: Node) -> bool:
    name = op_name(node) or getattr(node.target, "__name__", str(node.target))
    return any(r in str(name) for r in _RANDOM_OPS)


def _check_evaluable(node: Node, hints, sizes):
    meta = val(node)
    if isinstance(meta, torch.Tensor):
        numel = math.prod(_hint(d, sizes) for d in meta.shape) if hints else meta.numel()
        if not (hints or _is_static(meta)) or numel > _CONST_EVAL_MAX_NUMEL:
            raise _Skip("symbolic or large")


def _real_args(node: Node, memo: dict, hints, live: dict | None = None):
    """node's (args, kwargs) as real values: the constants they are, or (live) the values _eval_written
    holds for the members of a written tensor's family. A like-factory's template, read for its metadata
    only (_reads_metadata_only), is an empty tensor of its shape, dtype and device."""
    sizes = hints if isinstance(hints, dict) else None
    pos = _template_position(node)
    template = node.args[pos] if pos is not None and len(node.args) > pos else None
    if not (isinstance(template, Node) and _reads_metadata_only(node, template)):
        template = None

    def real(a):
        if live is not None and a in live:
            return live[a]
        if template is not None and a is template:
            meta = tensor_meta(a)
            if pos and op_name(node) in _TEMPLATE_CASTS:  # its dtype and device only (m.type_as(q), m.to(q))
                if meta is None:
                    raise _Skip("a template without a tensor value")
                with _real_mode():
                    return torch.empty(0, dtype=meta.dtype, device=meta.device)
            if meta is None or not (hints or _is_static(meta)):
                raise _Skip("a template without a static tensor value")
            shape = [_hint(d, sizes) if hints else d for d in meta.shape]
            with _real_mode():
                return torch.empty(shape, dtype=meta.dtype, device=meta.device)
        return _const_eval(a, memo, hints)

    return torch.fx.node.map_aggregate((node.args, node.kwargs), real)


def _call_real(node: Node, args_kwargs):
    args, kwargs = args_kwargs
    with torch.no_grad(), _real_mode():
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        return getattr(args[0], node.target)(*args[1:], **kwargs)


# Uses of a tensor that read its metadata only, never its values: a write after them changes nothing.
_METADATA_READS = ("size", "dim", "numel", "nelement", "ndimension", "stride", "is_contiguous")


def _eval_written(base: Node, members: list[Node], writers: list[Node], memo: dict, hints):
    """Evaluate a tensor written in place, and every view of it (members, _match.storage_family), into memo.

    A mask built by statements, ``m = torch.full((S, S), -inf); m.triu_(1)``, ``m[:, :p] = 0``,
    ``keep = torch.ones(S, S, dtype=bool); keep[None].tril_()``, is a constant as much as
    ``torch.full(..).triu(1)`` is (review s27: one with a dead row was rewritten as a runtime mask; s29: one
    read or written through a view was too, and a write through the result of ``torch.ones(..).tril_()``
    was dropped, the mask taken as causal). Taken only when every read of the memory (a use by a node
    that is no view of it nor a write into it) comes after the last write: each reader then sees the
    values the writes leave, which running the members in graph order on real tensors gives (a view sees
    the writes, a copy made before them does not, as in eager). Refused: a write whose other arguments are
    members (a tensor written from a view of itself), an out= write, anything random."""
    if base.op not in ("call_function", "call_method"):
        raise _Skip("reads a graph input")
    family = set(members)
    order = {n: i for i, n in enumerate(base.graph.nodes)}
    last = max(order[w] for w in writers)
    for m in members:
        if _nondeterministic(m):
            raise _Skip("nondeterministic")
        for u in m.users:
            if u in family or u in writers or op_name(u) in _METADATA_READS or _reads_metadata_only(u, m):
                continue
            if order[u] < last:
                raise _Skip("read before it is written in place")
    for w in writers:
        if w not in family or w.kwargs.get("out") is not None:
            raise _Skip("written through out=")
        refs: list[Node] = []
        torch.fx.node.map_arg((w.args[1:], w.kwargs), refs.append)
        if any(r in family for r in refs):
            raise _Skip("written from a view of its own memory")
    sizes = hints if isinstance(hints, dict) else None
    live: dict = {}
    for m in members:
        _check_evaluable(m, hints, sizes)
        args_kwargs = _real_args(m, memo, hints, live)
        result = _call_real(m, args_kwargs)
        if m is base and isinstance(result, torch.Tensor):
            storage = result.untyped_storage().data_ptr()
            if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == storage
                   for t in torch.utils._pytree.tree_leaves(args_kwargs)):
                result = result.clone()  # the writes go into base's own memory, never into a memo value
        live[m] = result
    memo.update(live)


def _real_mode():
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - older layout
        import contextlib

        return contextlib.nullcontext()
    return unset_fake_temporarily()


def _const_scalar(node) -> float | None:
    """A Python number, or a one-element constant tensor (torch.sqrt(torch.tensor(d))), as a float."""
    if is_number(node):
        return float(node)
    if not isinstance(node, Node):
        return None
    try:
        value = _const_eval(node)
    except Exception:  # noqa: BLE001 - anything not evaluable is not a constant
        return None
    if (
        isinstance(value, torch.Tensor)
        and value.numel() == 1
        and (value.is_floating_point() or not value.dtype.is_complex)
    ):
        return float(value.item())
    return float(value) if is_number(value) else None


def _fits(mask_shape, scores_shape) -> bool:
    if mask_shape is None or len(mask_shape) > len(scores_shape):
        return False
    try:
        return tuple(torch.broadcast_shapes(tuple(mask_shape), tuple(scores_shape))) == tuple(scores_shape)
    except RuntimeError:
        return False


def _precise_enough(dtype, source_dtype) -> bool:
    """A cast the attention may take without losing precision: back to the input dtype, or upwards."""
    if dtype == source_dtype:
        return True
    if dtype is None or not dtype.is_floating_point:
        return False
    limit = min(torch.finfo(source_dtype).eps, torch.finfo(torch.float32).eps)
    return torch.finfo(dtype).eps <= limit


def _strip_score_upcasts(cand, probs: Node) -> None:
    """q and k cast up to fp32 for the scores only (GPT-J, CodeGen, GPT-Neo: ``query.to(torch.float32)``,
    the softmax in fp32, the probabilities cast back to v's dtype before ·v): the op's own arithmetic, so q
    and k are taken before their casts (review s29: left alone in bf16 as "q, k, v and the output dtypes
    differ"). The same function: products of fp16 / bf16 values are exact in fp32, which the op's products
    accumulate in, as eager's fp32 matmul does; the softmax runs in fp32 in both, and P is rounded to v's
    dtype before P·V in both. Only a cast to float32 (not float64: the op accumulates in fp32) of a tensor of
    v's half-precision dtype, on both q and k, with the probabilities that reach ·v in v's dtype."""
    low = _dtype(cand.v)
    if low not in (torch.float16, torch.bfloat16) or _dtype(probs) != low:
        return
    if cand.q_scales or cand.symbolic_scales:
        return  # scales put on q in the graph: kept in the dtype they were written for
    sources = []
    for node in (cand.q, cand.k):
        if not (isinstance(node, Node) and op_name(node) in _CASTS and isinstance(node.args[0], Node)
                and _dtype(node) == torch.float32 and _dtype(node.args[0]) == low
                and _shape(node) == _shape(node.args[0])):
            return
        sources.append(node.args[0])
    cand.chain.extend([cand.q, cand.k])  # erased only if the rewrite leaves them without users
    cand.q, cand.k = sources


def _holds(cond) -> bool:
    """bool(cond); on symbolic sizes this adds a guard, so the rewrite is only reused where it holds."""
    try:
        return bool(cond)
    except Exception:  # noqa: BLE001 - data-dependent: cannot be proven
        return False


def _prod(dims):
    out = 1
    for d in dims:
        out = out * d
    return out


def _same_dims(a, b) -> bool:
    return len(a) == len(b) and all(_holds(x == y) for x, y in zip(a, b, strict=True))


def _check_leading_reshape(node: Node, what: str):
    """Raise unless node only splits or merges the leading dims of the (..., Sq, Sk) tensor it reshapes."""
    src, dst = _shape(node.args[0]), _shape(node)
    if src is None or dst is None:
        raise _Skip(f"'{node.name}' has no shape information")
    if _dtype(node) != _dtype(node.args[0]):
        # x.view(dtype) reinterprets the bits (float16 scores read as bfloat16): another function
        raise _Skip(f"'{node.name}' reinterprets the {what} as {_dtype(node)} (a view that changes the "
                    "dtype)")
    if (
        len(src) < 3
        or len(dst) < 3
        or not _same_dims(src[-2:], dst[-2:])
        or not _holds(_prod(src[:-2]) == _prod(dst[:-2]))
    ):
        raise _Skip(
            f"'{node.name}' reshapes the {what} {list(src)} -> {list(dst)}: only splits or merges of the "
            "leading (batch, head) dims are seen through, never of the last two (query, key) dims"
        )


def _view_lead_args(node: Node, n: int) -> list | None:
    """The first n size arguments of a view / reshape / unflatten(0, ...) node, as graph values (ints or
    SymInt nodes; one may be -1), to split a (batch·head) dim the same way under dynamic shapes."""
    name = op_name(node)
    sizes = None
    if name in ("view", "reshape"):
        sizes = list(node.args[1:]) or node.kwargs.get("size", node.kwargs.get("shape"))
        if sizes and len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
            sizes = list(sizes[0])
        if sizes is not None and len(sizes) != len(_shape(node) or ()):
            return None
    elif name == "unflatten" and norm_dim(arg(node, 1, "dim"), len(_shape(node.args[0]) or ())) == 0:
        sizes = arg(node, 2, "sizes")
    if not isinstance(sizes, (list, tuple)) or len(sizes) < n:
        return None
    lead = list(sizes[:n])
    for s in lead:
        scalar = isinstance(s, Node) and isinstance(val(s), (int, torch.SymInt))
        if not (scalar or isinstance(s, int) and not isinstance(s, bool)):
            return None
    return lead


def _check_op_limits(q_shape, k_shape, v_shape, dtype):
    """What flash_attention raises on, checked at compile time so the model keeps its eager attention."""
    from flash_backend.ops.attention import MAX_HEAD_DIM

    if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise _Skip(f"dtype {dtype} is not supported by the flash op")
    for name, d in (("q/k", q_shape[-1]), ("v", v_shape[-1])):
        if not (_holds(d % 8 == 0) and _holds(d <= MAX_HEAD_DIM) and _holds(d > 0)):
            raise _Skip(f"head_dim of {name} is {d}; the flash op takes multiples of 8 up to {MAX_HEAD_DIM}")
    if not _holds(q_shape[-1] == k_shape[-1]):
        raise _Skip("q and k head dims differ")
    if not (_holds(q_shape[0] == k_shape[0]) and _holds(k_shape[0] == v_shape[0])):
        raise _Skip(
            f"batch dims differ (q {q_shape}, k {k_shape}, v {v_shape}): broadcasting batch is not taken"
        )
    if not (_holds(k_shape[1] == v_shape[1]) and _holds(k_shape[2] == v_shape[2])):
        raise _Skip(f"k {k_shape} and v {v_shape} do not pair up")
    if not _holds(q_shape[1] % k_shape[1] == 0):
        raise _Skip(f"q heads ({q_shape[1]}) are not a multiple of k/v heads ({k_shape[1]})")


# --------------------------------------------------------------------------------------------------------
# Masks: what the scores' masking steps amount to, and whether a constant mask is causal
# --------------------------------------------------------------------------------------------------------


class _Masks:
    def __init__(self):
        self.keeps: list[tuple[Node, bool]] = []  # (bool tensor, negate): True = visible after negation
        self.additive: list[Node] = []
        self.negated: set[Node] = set()  # additive masks subtracted from the scores (s - m): the op adds -m
        # Integer (or bool) additive masks and the scores' dtype eager converts them to before adding: the
        # op gets m.to(dtype), the values eager adds (int -70000 is -inf in float16). Compile-time checks
        # look at those values too.
        self.casts: dict[Node, torch.dtype] = {}
        # The shape of the scores where each mask applies, when a view of their leading dims differs
        # from q·kᵀ's (a mask added to the (B, H, Sq, Sk) view of bmm's (B·H, Sq, Sk) scores).
        self.stages: dict[Node, tuple] = {}
        # Float keep masks proven to hold 0 and 1 only (_zero_one), which old GPT-2 multiplies the scores
        # by (_multiplicative_mask): visible where 1. Compile-time checks read them as bool (x.to(bool));
        # the op gets b != 0.
        self.zero_one: set[Node] = set()
        # A finite additive value (above _ADDITIVE_MASKED) that build took as -inf to fold a constant band
        # into causal (constant_keep), for the report; None when it took none.
        self.assumed_masked: float | None = None

    def empty(self) -> bool:
        return not self.keeps and not self.additive

    def nodes(self) -> list[Node]:
        return [n for n, _ in self.keeps] + list(self.additive)

    def check(self, scores_shape):
        for node in self.nodes():
            if not isinstance(node, Node) or tensor_meta(node) is None:
                raise _Skip("mask is not a tensor")
            stage = self.stages.get(node, scores_shape)
            if not _fits(_shape(node), stage):
                raise _Skip(
                    f"mask of shape {list(_shape(node))} does not broadcast to the scores "
                    f"{list(stage)} without enlarging them"
                )
        for node, _ in self.keeps:
            if _dtype(node) != torch.bool and node not in self.zero_one:
                raise _Skip(f"mask condition has dtype {_dtype(node)}, not bool")
        for node in self.additive:
            if not _dtype(node).is_floating_point and node not in self.casts:
                raise _Skip(f"additive mask has dtype {_dtype(node)}, not floating point")

    def value(self, node: Node, value):
        """A constant additive mask's value as eager adds it: converted to the scores' dtype (casts)."""
        if node not in self.casts:
            return value
        # a Python number (a where branch's scalar) as float64: exact for every value a float32 holds
        return torch.as_tensor(value, dtype=torch.float64 if isinstance(value, float) else None).to(
            self.casts[node])

    def constant_keep(self, sq: int, sk: int) -> tuple[torch.Tensor | None, float | None]:
        """(the visible-key pattern, or None unless every mask is a compile-time constant; the largest finite
        additive value taken as masked that is above _ADDITIVE_MASKED, or None).

        An additive value counts as masked at or below _MASKED_VALUE, the policy of a finite masked_fill
        (flash-attn's SelfAttention adds ``triu(full((S, S), -10000), 1)`` where Megatron fills -10000;
        review s31 M4): the band then folds into is_causal as a -inf one does. On the causal band, the only
        pattern build folds besides all-visible, every row keeps a key, so that band and -inf differ by
        terms of exp(s_masked - 1e4 - row max): 0 in float32 unless the scores of a row differ by about 1e4,
        the same assumption as the fills'. A pattern build does not fold keeps the mask's own values."""
        keep, assumed = None, None
        try:
            for node, negate in self.keeps:
                k = _const_eval(node).to(torch.bool)
                keep_i = ~k if negate else k
                keep = keep_i if keep is None else keep & keep_i
            for node in self.additive:
                m = self.value(node, _const_eval(node))
                m = -m if node in self.negated else m
                visible = m == 0
                masked = m <= _MASKED_VALUE
                if not bool((visible | masked).all()):
                    return None, None  # a real bias, not a mask
                finite = m[masked & (m > _ADDITIVE_MASKED)]
                if finite.numel():
                    assumed = max(float(finite.max()), assumed if assumed is not None else -math.inf)
                keep = visible if keep is None else keep & visible
        except Exception:  # noqa: BLE001 - not constant
            return None, None
        if keep is None or keep.shape[-2:] not in ((sq, sk), (1, sk), (sq, 1), (1, 1)):
            return None, None
        return keep.broadcast_to(keep.shape[:-2] + (sq, sk)).cpu(), assumed

    def constant_dead_row(self, sq, sk) -> Node | None:
        """A mask whose compile-time constant part leaves a query row with no visible key (a causal band
        off by one, ``tril(diagonal=-1)``; bottom-right causal with Sq > Sk), else None.

        The op gives 0 on such rows (on a finite additive mask, not eager's average either); eager's
        softmax gives NaN (-inf) or the uniform average of v (a finite fill such as finfo.min). For a
        runtime mask that is a degenerate input, reported; a constant one has that row for every input,
        so the rewrite would change the model's function. Each mask is looked at alone (a row is dead if
        one mask kills it) and all together; for a keep mask a & b & ..., its constant factors.

        Under dynamic shapes the masks are built from symbolic sizes, and the graph is reused for other
        sizes than the example's, where a band can leave rows without a key (a bottom-right band built for
        Sq <= Sk, run at Sq > Sk: review s26b). So the masks are evaluated at the example's sizes and at a
        set of others of the same order between Sq and Sk, and the graph is guarded on that order: a call
        of the other order recompiles, and is checked at its own sizes."""
        candidates = self._constant_parts()
        if isinstance(sq, int) and isinstance(sk, int):
            return self._dead_row_at(candidates, sq, sk, hints=False)
        try:
            hq, hk = _hint(sq), _hint(sk)
        except _Skip:
            return None
        dead = self._dead_row_at(candidates, hq, hk, hints=True)
        if dead is not None:
            return dead
        symbols = set()
        for size in (sq, sk):
            if isinstance(size, torch.SymInt):
                symbols |= size.node.expr.free_symbols
        if not symbols or len(symbols) > 3:
            return None
        env = next(size for size in (sq, sk) if isinstance(size, torch.SymInt)).node.shape_env
        symbols = sorted(symbols, key=str)
        # dynamo specialises sizes 0 and 1: a symbolic size is at least 2
        hints = [_backed_hints(env).get(sym) for sym in symbols]
        if any(h is None for h in hints):
            return None
        # Also at and past the masks' own integer constants (a window W, a diagonal offset): a band can lose
        # rows only once the sizes cross one of them (past >= W), which 2, 3, 17 and the example's + 64 may
        # not reach: a window of 100 checked at past = 6 and 70 was reused at past = 146 (review s26,
        # dynamic reuse).
        thresholds = _int_constants([part for _, part, _ in candidates])
        choices = [sorted({2, 3, 17, h, h + 64} | {v for c in thresholds for v in (c, c + 1, c + h + 64)})
                   for h in hints]
        query_first = hq <= hk
        for values in itertools.product(*choices):
            sizes = dict(zip(symbols, values, strict=True))
            at_q, at_k = _hint(sq, sizes), _hint(sk, sizes)
            if (at_q <= at_k) != query_first or at_q * at_k > _CONST_EVAL_MAX_NUMEL:
                continue  # the guard below keeps the graph from those sizes
            dead = self._dead_row_at(candidates, at_q, at_k, hints=sizes)
            if dead is not None:
                return dead
        from torch.fx.experimental.symbolic_shapes import guard_bool

        guard_bool(sq <= sk if query_first else sq > sk)
        return None

    def _constant_parts(self) -> list[tuple[Node, object, bool]]:
        """(mask, part, value is a keep mask) for each part of the masks that may be a constant."""
        candidates: list[tuple[Node, object, bool]] = []  # (mask, constant part, value is a keep mask)
        # A masked-positions condition or-ed from a constant and a runtime term (``triu(0) | ~pad``) is looked
        # at term by term, as a keep mask's factors are: its constant term's dead row went unseen (review
        # s30: rewritten, 0 where eager gives NaN or the average of v).
        for node, negate in self.keeps:
            candidates += [(node, part, is_keep) for part, is_keep in _visible_parts(node, negate)]
        for node in self.additive:
            candidates.append((node, node, False))
            # transformers' where(keep, 0, finfo.min) with a runtime padding factor: its constant factors
            where = _where_operands(node)
            if node not in self.negated and where is not None and _dtype(where[0]) == torch.bool:
                cond, a, b = where
                a, b = (None if c is None else float(self.value(node, c)) for c in map(_const_scalar, (a, b)))
                if a == 0 and b is not None and b <= _ADDITIVE_MASKED:
                    candidates += [(node, part, is_keep) for part, is_keep in _visible_parts(cond, False)]
                elif b == 0 and a is not None and a <= _ADDITIVE_MASKED:
                    candidates += [(node, part, is_keep) for part, is_keep in _visible_parts(cond, True)]
        return candidates

    def _dead_row_at(self, candidates, sq: int, sk: int, hints: bool | dict) -> Node | None:
        """The first mask whose constant parts, at these sizes, leave a query row with no visible key."""
        # Rows that every constant part together leaves without a key, over any batch and head: two masks
        # each fine alone can be dead together (a top-left causal band and a bottom-right window; review
        # s26b), and the op gives 0 there where eager gives NaN or the average of v, for every input.
        joint = None
        for node, part, is_keep in candidates:
            try:
                value = torch.as_tensor(_const_eval(part, hints=hints)).cpu()
            except Exception:  # noqa: BLE001 - a runtime mask or factor
                # or a bool one known all True / all False at any size (_runtime_row_only lets it pass)
                truth = _constant_truth(part) if _dtype(part) == torch.bool else None
                if truth is None:
                    continue
                value = torch.tensor(truth)
            if part is node and node in self.additive:
                value = self.value(node, value)
                value = -value if node in self.negated else value
                visible = ~(value <= _ADDITIVE_MASKED)  # NaN counts as visible: not a mask this proves
            else:
                visible = value.to(torch.bool) if is_keep else ~value.to(torch.bool)
            visible = visible.reshape((1,) * max(0, 2 - visible.dim()) + tuple(visible.shape))
            try:
                visible = visible.broadcast_to(visible.shape[:-2] + (sq, sk))
            except RuntimeError:
                continue
            if bool((~visible.any(-1)).any()):
                return node
            seen = visible.reshape(-1, sq, sk).any(0)
            joint = seen if joint is None else joint & seen
            if bool((~joint.any(-1)).any()):
                return node
        return None

    def row_only_keep(self, sk) -> Node | None:
        """A runtime keep mask, or a factor of one, that broadcasts over the key dim (shape (..., Sq, 1), or
        0-d) while there are several keys, else None.

        Such a mask masks every key of a query row or none: each row it masks at all is a row with no visible
        key, where eager's softmax gives NaN (-inf fill) or the uniform average of v (a finite fill such as
        -1e9 or finfo.min) and the op 0. The rewrite would differ from eager wherever the mask has an
        effect, on any input: another function, like the constant dead rows of constant_dead_row (a query
        padding mask ``masked_fill(~q_pad[:, None, :, None], -1e9)``, alone or and-ed with a key mask; review
        s26). A constant one is left to constant_dead_row (it masks nothing or is refused there)."""
        if isinstance(sk, int) and sk == 1:
            return None
        for node, negate in self.keeps:
            if not negate:
                parts = _keep_factors(node)
            elif isinstance(node, Node) and (op_name(node) in ("invert", "logical_not", "bitwise_not")) \
                    and isinstance(node.args[0], Node):
                parts = _keep_factors(node.args[0])  # masked_fill(~(a & b), ...): visible = a & b
            else:
                parts = _masked_terms(node)  # masked_fill(a | b, ...): masked where any term is
            found = _runtime_row_only(parts)
            if found is not None:
                return found
        # The same for an additive mask, or a term or factor of one: a value broadcast over the key dim adds
        # one number to a whole query row, and where that number masks (-inf, finfo.min) the row has no
        # visible key. A query padding mask written additively, ``s + (1 - q_pad[:, None, :, None]) * min``
        # or ``s + where(q_pad, 0, -inf)``, was rewritten (review s26b: 0 where eager gives NaN). A finite
        # shift of a row changes nothing in softmax; refused too, as it cannot be told apart at compile time.
        for node in self.additive:
            found = _runtime_row_only(_additive_parts(node))
            if found is not None:
                return found
        return None

    def build(self, graph: Graph, like: Node, sq: int, sk: int):
        """(attn_mask node or None, causal) for flash_attention; causal with a mask means window (-1, 0).

        causal is False, True (top-left, as SDPA's is_causal) or BOTTOM_RIGHT (the band aligned to the last
        key, j <= i + Sk - Sq: KV-cache decoding, chunked prefill), see _mask_kwargs."""
        if self.empty():
            return None, False
        keep, assumed = self.constant_keep(sq, sk)
        if keep is not None:
            if bool(keep.all()):
                return None, False
            causal = _causal_kind(keep)
            if causal:
                self.assumed_masked = assumed
                return None, causal
        causal = False
        keep_node = None
        factors: list[Node] = []
        for node, negate in self.keeps:
            runtime, is_causal = _split_keep(node, sq, sk, masked=negate)
            # (a 0 / 1 float mask, or a factor of one, as the bool mask the op takes: visible where 1)
            factors += [insert_call(graph, torch.logical_not, (part,), like=like) if not is_keep
                        else part if _dtype(part) == torch.bool
                        else insert_call(graph, torch.ne, (part, 0), like=like)
                        for part, is_keep in runtime]
            causal = _and_bands(causal, is_causal)
        for k in factors:
            keep_node = (
                k if keep_node is None else insert_call(graph, torch.logical_and, (keep_node, k), like=like)
            )
        add_node = None
        for node in self.additive:
            dtype = self.casts.get(node)
            if node in self.negated:  # converted first: -m of an int64 minimum wraps around
                if dtype is not None:
                    node = insert_call(graph, torch.Tensor.to, (node, dtype), like=like)
                node = insert_call(graph, torch.neg, (node,), like=like)
            else:
                node = _narrow_additive(graph, node, sq, sk, like)
                if dtype is not None:
                    node = insert_call(graph, torch.Tensor.to, (node, dtype), like=like)
            add_node = (
                node if add_node is None else insert_call(graph, torch.add, (add_node, node), like=like)
            )
        if add_node is None:
            return keep_node, causal
        if keep_node is None:
            return add_node, causal
        return insert_call(graph, torch.where, (keep_node, add_node, float("-inf")), like=like), causal


def _runtime_row_only(parts) -> Node | None:
    """The first of the mask parts that broadcasts over the key dim (shape (..., 1) or 0-d) and is not a
    compile-time constant (row_only_keep's subject), else None. A bool part provably all True or all False
    whatever the sizes (_constant_truth) is a constant too: it masks nothing (and_mask's scalar start under
    dynamic shapes, review s31 F1), or everything, which constant_dead_row refuses."""
    for part in parts:
        shape = _shape(part)
        if shape is None or shape and not (isinstance(shape[-1], int) and shape[-1] == 1):
            continue
        if _dtype(part) == torch.bool and _constant_truth(part) is not None:
            continue
        try:
            _const_eval(part)
        except Exception:  # noqa: BLE001 - a runtime mask: the one this check is about
            return part
    return None


def _int_constants(parts, limit: int = 3, max_nodes: int = 64) -> list[int]:
    """The largest `limit` distinct integer constants >= 2 (by absolute value) in the arguments of the nodes
    the mask parts are computed from (at most max_nodes of them): the thresholds where a band built from
    symbolic sizes may change shape (``j <= i + past - W``)."""
    found: set[int] = set()
    seen: set[Node] = set()
    stack = [p for p in parts if isinstance(p, Node)]

    def scan(a):
        if isinstance(a, (list, tuple)):
            for x in a:
                scan(x)
        elif isinstance(a, slice):
            scan((a.start, a.stop, a.step))
        elif isinstance(a, int) and not isinstance(a, bool) and 2 <= abs(a) <= _CONST_EVAL_MAX_NUMEL:
            found.add(abs(a))

    while stack and len(seen) < max_nodes:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op in ("call_function", "call_method"):
            scan((node.args, tuple(node.kwargs.values())))
            stack.extend(node.all_input_nodes)
    return sorted(found, reverse=True)[:limit]


def _causal_pattern(sq: int, sk: int) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool).tril()


# causal with the band aligned to the bottom-right corner (flash_attention's causal_alignment="bottom_right")
BOTTOM_RIGHT = "bottom_right"


def _causal_kind(keep: torch.Tensor):
    """True when a constant keep pattern (..., Sq, Sk), real and broadcast, is the top-left causal band,
    BOTTOM_RIGHT when it is the bottom-right one and differs from it (Sq < Sk: the band of a KV-cache decode
    step or a chunk of prefill, ``tril(diagonal=Sk - Sq)``), else False. The sizes are the constant's own
    (compile-time constants are never symbolic; the mask's broadcast to the scores guards them). Never
    bottom-right for Sq > Sk: that band leaves the first Sq - Sk query rows without a key (constant_dead_row
    refuses it before; refused here too)."""
    if keep.dim() < 2:
        return False
    sq, sk = keep.shape[-2:]
    if bool((keep == _causal_pattern(sq, sk)).all()):
        return True
    if sq < sk and bool((keep == torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)).all()):
        return BOTTOM_RIGHT
    return False


def _and_bands(a, b):
    """The band of two causal bands and-ed (False: none). Both are taken only for Sq <= Sk, where the top-left
    band is within the bottom-right one: their AND is the top-left band."""
    if not a or not b:
        return a or b
    return True if True in (a, b) else BOTTOM_RIGHT


_AND = ("and_", "__and__", "logical_and", "bitwise_and")


def _keep_factors(node) -> list:
    """The factors of a visible-keys mask built as a & b & ..., seen through expand and no-op .to."""
    name = op_name(node) if isinstance(node, Node) else None
    if node.op == "call_function" and node.target is operator.and_:
        name = "and_"
    if name in _AND and len(node.args) == 2 and all(_dtype(a) == torch.bool for a in node.args):
        return _keep_factors(node.args[0]) + _keep_factors(node.args[1])
    if name in ("expand", "expand_as", "contiguous") and isinstance(node.args[0], Node):
        return _keep_factors(node.args[0])
    if name == "to" and isinstance(node.args[0], Node):
        src, dst = tensor_meta(node.args[0]), tensor_meta(node)
        if src is not None and dst is not None and src.dtype == dst.dtype and src.device == dst.device:
            return _keep_factors(node.args[0])
    return [node]


_OR = ("or_", "__or__", "logical_or", "bitwise_or")


def _masked_terms(node) -> list:
    """The terms of a masked-positions condition built as a | b | ... (each masks where it is True)."""
    name = op_name(node) if isinstance(node, Node) else None
    if isinstance(node, Node) and node.op == "call_function" and node.target is operator.or_:
        name = "or_"
    if name in _OR and len(node.args) == 2 and all(_dtype(a) == torch.bool for a in node.args):
        return _masked_terms(node.args[0]) + _masked_terms(node.args[1])
    if name in ("expand", "expand_as", "contiguous") and isinstance(node.args[0], Node):
        return _masked_terms(node.args[0])
    return [node]


_NOT = ("invert", "logical_not", "bitwise_not")


def _visible_parts(cond, masked: bool) -> list[tuple[object, bool]]:
    """(part, is_keep) pairs whose visible keys, ANDed, are cond's: a keep condition's factors (a & b & ...,
    is_keep True: visible where the part holds), a masked-positions condition's terms (a | b | ..., is_keep
    False: visible where the part does not hold), seen through a negation (``masked_fill(~(a & b), ..)``
    masks where the keep condition a & b fails)."""
    if isinstance(cond, Node) and op_name(cond) in _NOT and len(cond.args) == 1 and not cond.kwargs \
            and isinstance(cond.args[0], Node) and _dtype(cond.args[0]) == torch.bool:
        return _visible_parts(cond.args[0], not masked)
    if masked:
        return [(t, False) for t in _masked_terms(cond)]
    return [(f, True) for f in _keep_factors(cond)]


def _additive_parts(node, depth: int = 8) -> list:
    """An additive mask, its terms (m1 + m2, seen through expand and casts: used to refuse only) and, for
    ``where(cond, 0, fill)`` / ``where(cond, fill, 0)``, the factors or terms of its condition."""
    if not isinstance(node, Node) or depth == 0:
        return []
    parts = [node]
    name = op_name(node)
    if name == "add" and _plain_binary(node):
        parts += [p for a in _operands(node) for p in _additive_parts(a, depth - 1)]
    elif name in ("expand", "expand_as", "contiguous", "to", "float", "type_as") and isinstance(node.args[0],
                                                                                                Node):
        parts += _additive_parts(node.args[0], depth - 1)
    elif _where_operands(node) is not None and _dtype(_where_operands(node)[0]) == torch.bool:
        cond, a, b = _where_operands(node)
        if _const_scalar(a) == 0:
            parts += _keep_factors(cond)
        elif _const_scalar(b) == 0:
            parts += _masked_terms(cond)
    return parts


def _split_keep(node: Node, sq: int, sk: int, masked: bool = False) -> tuple[list[tuple[Node, bool]], bool]:
    """A bool keep-mask as (runtime parts, causal): constant factors that keep everything are dropped,
    a constant causal factor becomes the causal band. The runtime parts keep their own (smaller)
    broadcast shapes, so a padding mask reaches the kernel as one row per batch, not (B, 1, Sq, Sk).
    Exact: visible = AND of the parts' visible keys (_visible_parts), and the band is the causal factor.

    masked: node marks the masked positions instead (masked_fill's condition, a where's with the scores
    second), a | b | ...: a padding mask and a constant triu(1) filled in turn, or or-ed, become the padding
    mask and the causal band (review s30: the whole mask before). Each runtime part is (part, is_keep):
    visible where it holds (is_keep) or where it does not."""
    parts = _visible_parts(node, masked)
    runtime, constant = [], None
    for part, is_keep in parts:
        if _constant_truth(part, evaluate=False) is is_keep:
            # masks nothing at any size (and_mask's scalar start new_ones((), bool), also under dynamic
            # shapes, where it is no compile-time constant): dropped, as a constant that keeps everything is
            continue
        try:
            value = _const_eval(part)
        except Exception:  # noqa: BLE001 - a runtime factor
            runtime.append((part, is_keep))
            continue
        # Compile-time constants are compared on the CPU, whatever device the model runs on.
        value = torch.as_tensor(value).to(torch.bool).cpu()
        value = value if is_keep else ~value
        constant = value if constant is None else constant & value
    whole = [(node, not masked)]
    if constant is None:
        return (runtime if len(parts) > 1 or not runtime else whole), False
    if not (isinstance(sq, int) and isinstance(sk, int)):
        return whole, False  # a constant against symbolic sizes: kept whole (an internal error before)
    if constant.shape[-2:] not in ((sq, sk), (1, sk), (sq, 1), (1, 1)) and constant.dim() >= 2:
        return whole, False
    constant = constant.broadcast_to(constant.shape[:-2] + (sq, sk)) if constant.dim() >= 2 else constant
    if bool(constant.all()):
        return runtime, False
    causal = _causal_kind(constant)
    if causal:
        return runtime, causal
    return whole, False


def _narrow_additive(graph: Graph, node: Node, sq: int, sk: int, like: Node) -> Node:
    """where(keep, 0, fill) with keep = (all-visible constant) & padding ... -> where(padding, 0, fill): the
    same values after broadcasting, one row per batch. A causal constant factor stays (an additive fill
    and the causal band differ on rows with no visible key)."""
    where = _where_operands(node)
    if where is None or not isinstance(where[0], Node):
        return node
    cond = where[0]
    if _dtype(cond) != torch.bool:
        return node
    runtime, causal = _split_keep(cond, sq, sk)
    if causal or not runtime or runtime == [(cond, True)]:
        return node
    keeps = [part if is_keep else insert_call(graph, torch.logical_not, (part,), like=like)
             for part, is_keep in runtime]
    keep = keeps[0]
    for k in keeps[1:]:
        keep = insert_call(graph, torch.logical_and, (keep, k), like=like)
    return insert_call(graph, torch.where, (keep, where[1], where[2]), like=like)


# --------------------------------------------------------------------------------------------------------
# The scores side: softmax input -> ... -> q·kᵀ
# --------------------------------------------------------------------------------------------------------


# Elementwise bounds: torch.max / torch.min of two tensors, maximum / minimum, clamp and its spellings.
_BOUNDS = ("max", "min", "maximum", "minimum", "clamp", "clip", "clamp_min", "clamp_max")


def _bound_parts(node) -> tuple[list, object, object] | None:
    """(tensor operands, lower bound, upper bound) of an elementwise bound: ``torch.max(a, b)`` /
    ``maximum`` ([a, b], the other of the two, None: the caller picks), ``min`` / ``minimum`` (None as the
    lower bound), ``clamp(x, min, max)`` / ``clip``, ``clamp_min``, ``clamp_max`` ([x], min, max). None for
    anything else, the reductions ``torch.max(x, dim)`` / ``x.max(-1, keepdim=True)`` among them."""
    name = op_name(node) if isinstance(node, Node) else None
    if name not in _BOUNDS:
        return None
    x = arg(node, 0, "input")
    if not isinstance(x, Node):
        return None
    if name in ("max", "min", "maximum", "minimum"):
        other = arg(node, 1, "other")
        if not (isinstance(other, Node) and tensor_meta(other) is not None) \
                or len(node.args) + len(node.kwargs) != 2:
            return None  # a reduction over a dim (or a malformed call)
        return ([x, other], other, None) if name in ("max", "maximum") else ([x, other], None, other)
    if name == "clamp_min":
        return [x], arg(node, 1, "min"), None
    if name == "clamp_max":
        return [x], None, arg(node, 1, "max")
    return [x], arg(node, 1, "min"), arg(node, 2, "max")


def _score_clamp(x: Node) -> tuple[Node, float] | None:
    """(scores, bound) for a clamp of the scores from below at a constant: ``torch.max(s, c)``,
    ``torch.maximum(c, s)``, ``s.clamp(min=c)``, ``s.clamp_min(c)`` (the old BART / OPT / XGLM overflow
    guard ``torch.max(s, torch.full((), finfo(s.dtype).min))``); the bound is as the op compares it, in
    the result's dtype. Raise for any other bound of the scores, which the op cannot take; None when x is
    no bound at all."""
    parts = _bound_parts(x)
    if parts is None:
        return None
    operands, low, high = parts
    scores = next((a for a in operands if _reaches_matmul(a)), None)
    if len(operands) == 2:
        if scores is operands[1]:  # torch.max(c, s): the bound is the other operand
            low = None if low is None else operands[0]
            high = None if high is None else operands[0]
        if all(_reaches_matmul(a) for a in operands):
            raise _Skip(f"'{x.name}' takes the elementwise max / min of two tensors that both reach q·kᵀ")
    if scores is None:
        return None
    if high is not None or low is None:
        raise _Skip(f"'{x.name}' clamps the scores from above: another function than softmax of the scores")
    bound = _const_scalar(low)
    dtype = _dtype(x)
    if (bound is None or dtype is None or not dtype.is_floating_point or _dtype(scores) != dtype
            or isinstance(low, Node) and tensor_meta(low) is not None and tensor_meta(low).dim() > 0):
        raise _Skip(f"'{x.name}' clamps the scores from below at {getattr(low, 'name', low)}: only a 0-d "
                    "constant or a number is taken, in the scores' dtype")
    # The bound as the comparison sees it: converted to the result's dtype (finfo(float32).min against
    # float16 scores is -inf)
    bound = float(torch.tensor(bound, dtype=torch.float64).to(dtype))
    if bound != float("-inf") and bound != torch.finfo(dtype).min:
        raise _Skip(f"'{x.name}' clamps the scores from below at {bound:.6g}: a bound above the {dtype} "
                    f"minimum ({torch.finfo(dtype).min:.6g}) changes finite scores; only finfo.min or -inf "
                    "(the overflow guard, the identity on finite scores) is taken")
    if not _same_dims(_shape(x) or (), _shape(scores) or ()):
        raise _Skip(f"'{x.name}' broadcasts the scores {list(_shape(scores) or [])} to "
                    f"{list(_shape(x) or [])}")
    return scores, bound


# The elementwise ops the scores pass through between q·kᵀ and the softmax (scale, mask, fill), which the
# graph walks from a softmax input see through (_reaches_matmul, _concatenated_scores)
_SCORE_ELEMENTWISE = ("mul", "div", "add", "sub", "masked_fill", "where")


def _reaches_matmul(node, depth: int = 16, seen: set | None = None) -> bool:
    """Whether node is a matmul seen through elementwise score ops (each node visited once)."""
    seen = set() if seen is None else seen
    if not isinstance(node, Node) or depth == 0 or node in seen:
        return False
    seen.add(node)
    name = op_name(node)
    if name in _SCORE_MATMULS:
        return True
    if name in _RESHAPES or node.op == "call_function" and node.target in IN_PLACE_OPERATORS:
        # an augmented assignment left in place (on a view) is reported by the walk, not ignored
        return _reaches_matmul(node.args[0], depth - 1, seen)
    bound = _bound_parts(node)
    if bound is not None and bound[1] is not None and bound[2] is None:
        # scores clamped from below (XGLM's torch.max(s, finfo.min)): taken or reported by the walk
        # (_score_clamp). A clamp from above changes the large scores: no candidate, as before.
        return any(_reaches_matmul(a, depth - 1, seen) for a in bound[0])
    if name in _CASTS + _IDENTITY + _SCORE_ELEMENTWISE + ("masked_fill_",):
        # operands by position or keyword (torch.mul(s, other=c)); not a cast's template (m.type_as(s))
        return any(_reaches_matmul(a, depth - 1, seen) for a in _value_inputs(node))
    return False


def _residual_scores_operands(add: Node, a, b) -> tuple[bool, bool]:
    """(a is the scores, b is) for `a + b` when both reach a q·kᵀ: residual attention (RealFormer, PatchTST's
    res_attention: ``s + prev``, the previous layer's raw scores, which its own softmax also reads). The
    operand that this add alone reads is the scores; the other, read elsewhere too, was computed anyway and
    is an additive mask (one that may require grad). softmax(a + b) is the same function whichever is called
    the mask; what decides is that the op computes only a q·kᵀ nothing else reads (the walk still checks
    every intermediate of the chain it takes). Both read elsewhere, or neither: no way to tell, (False,
    False)."""
    shared = [n for n in (a, b) if not (isinstance(n, Node) and set(n.users) == {add})]
    if len(shared) != 1:
        return False, False
    return shared[0] is b, shared[0] is a


def _masked_or_zero_value(v, factor: float) -> bool:
    """v (a number or a constant tensor) is 0 or a masked-out value, also once multiplied by factor > 0."""
    t = torch.as_tensor(v, dtype=torch.float64)
    return bool(((t == 0) | ((t <= _MASKED_VALUE) & (t * factor <= _MASKED_VALUE))).all())


_MASK_PASSTHROUGH = ("expand", "expand_as", "contiguous", "view", "reshape", "unsqueeze", "squeeze",
                     "getitem", "to", "float", "type_as",
                     # copies of its values, one per head (a (B, 1, S) mask brought to baddbmm's (B·H, 1, S))
                     "repeat", "repeat_interleave")


def _zero_or_masked(node, factor: float, depth: int = 12) -> bool:
    """Whether an additive mask takes only the value 0 and masked-out values (at or below _MASKED_VALUE,
    also once multiplied by factor): a constant, torch.where(cond, a, b) or x.masked_fill(cond, v) of such
    values, sums of such masks, seen through views, slices and float casts. transformers' eager masks are
    `torch.where(keep, 0.0, finfo.min)`."""
    if is_number(node):
        return _masked_or_zero_value(node, factor)
    if not isinstance(node, Node) or depth == 0:
        return False
    meta = tensor_meta(node)
    if meta is None or not meta.dtype.is_floating_point:
        return False
    name = op_name(node)
    if node.op == "call_function" and node.target is operator.getitem:
        name = "getitem"
    if _where_operands(node) is not None:
        return all(_zero_or_masked(a, factor, depth - 1) for a in _where_operands(node)[1:])
    if name in ("masked_fill", "masked_fill_") and len(node.args) == 3 and not node.kwargs:
        return _zero_or_masked(node.args[0], factor, depth - 1) and _zero_or_masked(
            node.args[2], factor, depth - 1)
    if name == "add" and _plain_binary(node):
        return all(_zero_or_masked(a, factor, depth - 1) for a in _operands(node))
    if (name in _MASK_PASSTHROUGH and isinstance(node.args[0], Node) and tensor_meta(node.args[0]) is not None
            # a view to another dtype reinterprets the bits: not the values of its argument
            and (name != "view" or _dtype(node.args[0]) == meta.dtype)):
        if _zero_or_masked(node.args[0], factor, depth - 1):
            return True
    if meta.numel() <= _CONST_EVAL_MAX_NUMEL:
        try:
            return _masked_or_zero_value(_const_eval(node), factor)
        except Exception:  # noqa: BLE001 - not a compile-time constant
            return False
    return False


# Ops whose result holds only values of their (first) argument, or zeros: 0 / 1 in, 0 / 1 out.
_VALUE_SUBSETS = ("getitem", "view", "reshape", "expand", "expand_as", "contiguous", "clone", "unsqueeze",
                  "squeeze", "flatten", "unflatten", "transpose", "permute", "narrow", "select", "detach",
                  "repeat", "repeat_interleave", "tril", "triu", "broadcast_to")
# Factories of zeros or ones (no fill value to read).
_ZERO_ONE_FACTORIES = ("ones", "zeros", "ones_like", "zeros_like", "new_ones", "new_zeros")


def _zero_one(node, depth: int = 12) -> bool:
    """Whether a tensor provably holds 0 and 1 only, whatever the inputs: a bool tensor (and any cast of
    one: ``keep.float()``, ``keep.to(w.dtype)``, ``keep.type_as(w)``), a factory of ones or zeros and its
    tril / triu (``torch.tril(torch.ones(S, S))``), views, slices and copies of those, products of two of
    them, or a compile-time constant of 0s and 1s. Seen through structurally also under dynamic shapes.
    A runtime float or integer tensor (a registered buffer, which dynamo passes as a graph input) is not:
    its values are not known at compile time, nor are those of anything written in place."""
    if not isinstance(node, Node) or depth == 0 or tensor_meta(node) is None:
        return False
    if _dtype(node) == torch.bool:
        return True
    name = op_name(node)
    if not in_place_writers(node):
        if name in _ZERO_ONE_FACTORIES:
            return True
        if name == "mul" and _plain_binary(node):
            return all(_zero_one(a, depth - 1) for a in _operands(node))
        source = node.args[0] if node.args else None
        if (name in _VALUE_SUBSETS + _CASTS and isinstance(source, Node) and tensor_meta(source) is not None
                # a view to another dtype reinterprets the bits: not the values of its argument
                and (name != "view" or _dtype(source) == _dtype(node))
                and _zero_one(source, depth - 1)):
            return True
    try:
        value = _const_eval(node)
    except Exception:  # noqa: BLE001 - a runtime tensor: its values are not known
        return False
    return isinstance(value, torch.Tensor) and bool(((value == 0) | (value == 1)).all())


# Factories whose values are known whatever the inputs (a template is read for its metadata only), each with
# the position of its fill value, or the value itself.
_FILL_FACTORIES = {"ones": 1, "ones_like": 1, "new_ones": 1, "zeros": 0, "zeros_like": 0, "new_zeros": 0,
                   "full": (1, "fill_value"), "full_like": (1, "fill_value"), "new_full": (2, "fill_value")}
# Ops whose result holds values of their first argument only and adds none (no zeros: not tril / triu).
_TRUTH_KEEPING = tuple(n for n in _VALUE_SUBSETS if n not in ("tril", "triu"))
_NOT_ANY_DTYPE = ("logical_not",)
_TRUTH_CASTS = _CASTS + ("bool", "int", "long")


def _constant_truth(node, depth: int = 12, evaluate: bool = True) -> bool | None:
    """True when every element of node is provably True (nonzero), False when provably False (zero), for
    every input and every size, else None. evaluate=False: from the structure only, never by evaluating a
    constant (_const_eval), for callers that evaluate it themselves.

    transformers' and_mask starts from ``q_idx.new_ones((), dtype=torch.bool)`` and ands the causal and
    padding factors into it (or_mask from ``new_zeros``): a factor that masks nothing. Under dynamic shapes
    the template has symbolic sizes, so the factor is no compile-time constant (_const_eval), and a 0-d one
    was taken for a runtime mask of whole query rows (review s31, F1: every eager-attention transformers
    model with a padding mask left alone under dynamic=True). Proven from the structure, so symbolic sizes
    do not matter: a factory of ones, zeros or a constant fill (``full(.., True)``), never written in place,
    seen through views, slices, copies and expands (values of their argument only), casts that keep zero
    and nonzero apart (to or from bool), and, or and not of such; else a compile-time constant."""
    if not isinstance(node, Node) or depth == 0 or tensor_meta(node) is None or in_place_writers(node):
        return None
    name = op_name(node)
    if node.op == "call_function" and node.target in (operator.and_, operator.or_, operator.invert):
        name = {operator.and_: "and_", operator.or_: "or_", operator.invert: "invert"}[node.target]
    if name in _FILL_FACTORIES and node.kwargs.get("out") is None:
        fill = _FILL_FACTORIES[name]
        if isinstance(fill, tuple):
            fill = arg(node, *fill)
            if not (is_number(fill) or isinstance(fill, bool)) or isinstance(fill, complex):
                return None
        # the fill as the factory stores it: full((), 0.5, dtype=torch.int64) holds 0
        stored = torch.tensor(fill, dtype=torch.float64 if isinstance(fill, float) else None).to(_dtype(node))
        return bool(stored != 0)
    if name in _AND + _OR and len(node.args) == 2 and not node.kwargs \
            and all(_dtype(a) == torch.bool for a in node.args):
        truths = [_constant_truth(a, depth - 1, evaluate) for a in node.args]
        absorbing = name in _OR  # True absorbs an or, False an and
        if absorbing in truths:
            return absorbing
        return truths[0] if truths[0] is not None and truths[0] == truths[1] else None
    if name in _NOT and len(node.args) == 1 and not node.kwargs \
            and (name in _NOT_ANY_DTYPE or _dtype(node.args[0]) == torch.bool):
        truth = _constant_truth(node.args[0], depth - 1, evaluate)
        return None if truth is None else not truth
    source = node.args[0] if node.args else None
    if name == "repeat_interleave" and len(node.args) + len(node.kwargs) < 2:
        source = None  # torch.repeat_interleave(repeats) returns indices, not the values of repeats
    dtypes = (_dtype(source), _dtype(node)) if isinstance(source, Node) else ()
    if tensor_meta(source) is not None and (
        name in _TRUTH_KEEPING and dtypes[0] == dtypes[1]
        # a cast keeps zero and nonzero apart to or from bool only (0.5 to an integer is 0, 1e-50 to float32
        # is 0), and when it keeps the dtype (.to(device))
        or name in _TRUTH_CASTS and (dtypes[0] == dtypes[1] or torch.bool in dtypes)
    ):
        truth = _constant_truth(source, depth - 1, evaluate)
        if truth is not None:
            return truth
    if not evaluate:
        return None
    try:
        value = torch.as_tensor(_const_eval(node))
    except Exception:  # noqa: BLE001 - a runtime tensor (or one of symbolic size): not known
        return None
    if bool((value != 0).all()):
        return True
    return False if not bool(value.any()) else None


def _multiplicative_mask(node: Node) -> tuple[Node, Node, Node, Node, float] | None:
    """(scores, b, b again, product, fill) when node is ``scores * b - c * (1 - b)`` or ``scores * b + k *
    (1 - b)`` (old GPT-2 and OpenAI GPT: ``w = w * b - 1e4 * (1 - b)``, early Megatron: ``torch.mul(s,
    ltor_mask) - 10000.0 * (1.0 - ltor_mask)``), operands in either order, with c (k) a number; fill the
    value it leaves where b is 0 (-c, k); b again the tensor in ``1 - b``, product the scores * b node.
    Else None: the form only, _scores_side proves the rest (b the same tensor in both places, b 0 / 1)."""
    name = op_name(node)
    if name not in ("sub", "add") or not _plain_binary(node):
        return None
    a, b = _operands(node)
    for product, penalty in [(a, b)] if name == "sub" else [(a, b), (b, a)]:
        factors = _operands(product) if op_name(product) == "mul" and _plain_binary(product) else None
        terms = _operands(penalty) if op_name(penalty) == "mul" and _plain_binary(penalty) else None
        if factors is None or terms is None:
            continue
        for scores, mask in (factors, factors[::-1]):
            if not (isinstance(mask, Node) and tensor_meta(mask) is not None and _reaches_matmul(scores)
                    and not _reaches_matmul(mask)):
                continue
            for c, one_minus in (terms, terms[::-1]):
                pair = _operands(one_minus) if op_name(one_minus) == "sub" and _plain_binary(one_minus) \
                    else None
                if isinstance(c, (int, float)) and not isinstance(c, bool) and pair is not None \
                        and is_number(pair[0]) and pair[0] == 1:
                    return scores, mask, pair[1], product, -float(c) if name == "sub" else float(c)
    return None


def _softcapped(node, depth: int = 16, seen: set | None = None) -> bool:
    """Whether node reaches q·kᵀ through a tanh (`tanh(s / cap) * cap`, Gemma 2's logit soft-capping)."""
    seen = set() if seen is None else seen
    if not isinstance(node, Node) or depth == 0 or node in seen:
        return False
    seen.add(node)
    name = op_name(node)
    if name == "tanh":
        return isinstance(node.args[0], Node) and (
            _reaches_matmul(node.args[0]) or _softcapped(node.args[0], depth - 1, seen)
        )
    if name in _RESHAPES + _CASTS + _IDENTITY + ("mul", "div", "add", "masked_fill", "where", "sub"):
        return any(_softcapped(a, depth - 1, seen) for a in _value_inputs(node))
    return False


def _scalar_factor(node):
    """A constant as a float; a symbolic scalar (dynamic=True turns float attributes into inputs) as its
    node; anything else None."""
    c = _const_scalar(node)
    if c is not None:
        return c
    if isinstance(node, Node) and isinstance(val(node), (torch.SymFloat, torch.SymInt, float, int)):
        return node
    return None


def _plain_binary(node: Node) -> bool:
    """Two operands (by position or keyword: _match.binary_operands) and no keyword changing the op:
    `torch.div(s, 8, rounding_mode="floor")` rounds, `torch.sub(s, 1, alpha=1e9)` scales the operand."""
    return binary_operands(node, op_name(node)) is not None


def _scale_operand(node: Node):
    """(tensor operand, factor) of a multiply or divide by a scalar, else None.

    factor is a float, or ("mul" | "div", node) for a symbolic scalar.
    """
    name = op_name(node)
    if name not in ("mul", "div") or not _plain_binary(node):
        return None
    a, b = _operands(node)
    if name == "div":
        c = _scalar_factor(b)
        if c is None or not isinstance(a, Node) or tensor_meta(a) is None:
            return None
        if isinstance(c, Node):
            return a, ("div", c)
        return (a, 1.0 / c) if c != 0 else None
    for x, y in ((a, b), (b, a)):
        c = _scalar_factor(y)
        if c is not None and isinstance(x, Node) and tensor_meta(x) is not None:
            return x, (("mul", c) if isinstance(c, Node) else c)
    return None


def _strip_scales(cand, node: Node, consumer: Node) -> Node:
    """Fold scalar multiplies/divides on q or k (only when the scaled tensor feeds nothing else)."""
    while isinstance(node, Node) and _single_user(node, consumer):
        scaled = _scale_operand(node)
        if scaled is None or tensor_meta(node).shape != tensor_meta(scaled[0]).shape:
            break
        cand.chain.append(node)
        consumer, node = node, scaled[0]
        cand.fold(scaled[1])
    return node


def _movedim_perm(node: Node, ndim: int) -> list[int]:
    """The permute that ``x.movedim(source, destination)`` (torch.movedim, moveaxis; ints or sequences)
    performs: each source dim goes to its destination, the others keep their order in the places left.
    ``k.movedim(-1, -2)``, ``k.movedim(3, 2)`` and ``k.movedim(2, 3)`` all swap the last two dims."""
    src, dst = arg(node, 1, "source"), arg(node, 2, "destination")
    src, dst = ([d] if isinstance(d, int) else list(d) if isinstance(d, (list, tuple)) else None
                for d in (src, dst))
    if src is None or dst is None or len(src) != len(dst) \
            or not all(isinstance(d, int) and -ndim <= d < ndim for d in src + dst):
        raise _Skip(f"'{node.name}' moves dims {src} to {dst}: not dims of the {ndim}-d k")
    src, dst = [norm_dim(d, ndim) for d in src], [norm_dim(d, ndim) for d in dst]
    if len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise _Skip(f"'{node.name}' moves repeated dims")
    perm: list[int | None] = [None] * ndim
    for s, d in zip(src, dst, strict=True):
        perm[d] = s
    rest = iter(d for d in range(ndim) if d not in src)
    return [next(rest) if p is None else p for p in perm]


def _untranspose(kt: Node, ndim: int) -> tuple[Node, list[int] | None]:
    """(k, k_perm) when kt is kᵀ: k with its last two dims swapped (transpose, swapaxes / swapdims, permute,
    movedim / moveaxis, .mT, adjoint), k_perm None; or kᵀ in one permute (or movedim) of a tensor in another
    layout, k_perm the permute that lays that tensor out as (batch..., S, D). Else raise."""
    name = op_name(kt)
    if name in ("transpose", "swapaxes", "swapdims"):
        # swapaxes names its dims axis0 / axis1 (k.swapaxes(axis0=-1, axis1=-2): a TypeError before, s28)
        keys = ("axis0", "axis1") if name == "swapaxes" else ("dim0", "dim1")
        dims = [norm_dim(arg(kt, i + 1, key), ndim) for i, key in enumerate(keys)]
        if None not in dims and sorted(dims) == [ndim - 2, ndim - 1]:
            return kt.args[0], None
        raise _Skip(f"k is transposed over dims {dims}, not its last two")
    reverse = kt.op == "call_function" and kt.target is getattr and kt.args[1] == "T"
    if name in ("permute", "movedim", "moveaxis") or reverse:
        # x.T reverses every dim (deprecated beyond 2-d, where it is not a swap of the last two): the
        # permute (ndim-1, ..., 0)
        if reverse:
            perm = list(range(ndim))[::-1]
        elif name != "permute":
            perm = _movedim_perm(kt, ndim)
        else:
            perm = kt.args[1:] if len(kt.args) > 1 else kt.kwargs.get("dims", ())
        if len(perm) == 1 and isinstance(perm[0], (list, tuple)):
            perm = perm[0]
        perm = [norm_dim(d, ndim) for d in perm]
        if perm == list(range(ndim - 2)) + [ndim - 1, ndim - 2]:
            return kt.args[0], None
        # kᵀ = base.permute(perm) is k = base.permute(perm with its last two swapped), transposed: the
        # (B, S, H, D) projection permuted (0, 2, 3, 1) straight into (B, H, D, S). Exact for any perm, but
        # one that reorders the batch dims pairs each query with another (batch, head)'s keys: that is
        # most likely a bug in the model, and is left to eager, reported.
        if sorted(perm) == list(range(ndim)) and perm[:-2] == sorted(perm[:-2]):
            return kt.args[0], perm[:-2] + [perm[-1], perm[-2]]
        raise _Skip(f"k is permuted by {perm}, not by a swap of its last two dims (nor into kᵀ from "
                    "another layout with its batch dims in order)")
    if kt.op == "call_function" and kt.target is getattr and kt.args[1] in ("mT", "mH"):
        return kt.args[0], None
    if kt.op == "call_method" and kt.target in ("t",):
        return kt.args[0], None
    if name == "adjoint":  # kᵀ conjugated: the same for the real dtypes the op takes (complex is refused)
        return kt.args[0], None
    # Any other right operand is kᵀ stored as it is, (batch..., D, Sk) (timm's MaxViT / CoAtNet Attention2d
    # and EfficientFormer's Attention4D keep q, k, v channels-first: ``q.transpose(-2, -1) @ k``): q @ kt =
    # q @ (ktᵀ)ᵀ for any kt, so k is kt with its last two dims swapped, a view the op reads (review s33).
    if len(_shape(kt) or ()) == ndim:
        return kt, list(range(ndim - 2)) + [ndim - 1, ndim - 2]
    raise _Skip(f"the right operand of q·kᵀ ({name or kt.target}) is not a transpose of k's last two dims")


def _parse_einsum(eq: str, n_in: int, ndims: list[int | None] | None = None) -> tuple[list[str], str]:
    """The operands' and the output's subscripts; an ellipsis ("...qd,...kd->...qk") is spelled out in
    letters the equation does not use, given each operand's ndim, when it stands for the same number of
    leading dims in every operand and the output (then it is the same contraction written with names)."""
    eq = eq.replace(" ", "")
    if "->" not in eq:
        raise _Skip(f"einsum '{eq}' has no explicit output")
    lhs, out = eq.split("->")
    ins = lhs.split(",")
    if "." in eq:
        terms = ins + [out]
        counts = set()
        for term, ndim in zip(ins, ndims or [None] * len(ins), strict=False):
            if not term.startswith("...") or "." in term[3:] or ndim is None:
                counts.add(None)
            else:
                counts.add(ndim - len(term) + 3)
        if (len(ins) != n_in or len(counts) != 1 or None in counts or min(counts) < 0
                or any(not t.startswith("...") or "." in t[3:] for t in terms)):
            raise _Skip(f"einsum '{eq}' uses an ellipsis that is not the same leading dims of every operand")
        free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq][: counts.pop()]
        ins, out = ["".join(free) + t[3:] for t in ins], "".join(free) + out[3:]
        eq = ",".join(ins) + "->" + out
    if len(ins) != n_in or any(len(set(s)) != len(s) for s in ins + [out]):
        raise _Skip(f"einsum '{eq}' is not a plain two-operand contraction")
    return ins, out


class _Candidate:
    """Everything the replacement needs, collected while proving the match."""

    def __init__(self):
        self.chain: list[Node] = []  # nodes the rewrite makes dead
        self.scale = 1.0
        self.symbolic_scales: list[tuple[str, Node]] = []  # ("mul" | "div", SymFloat node)
        # ("mul" | "div", tensor constant along the key dim, scores' shape where it applies): put on q
        self.q_scales: list[tuple[str, Node, tuple]] = []
        self.masks = _Masks()
        self.q = self.k = self.v = None
        self.q_perm = self.k_perm = self.v_perm = None  # permutes into (batch..., S, D)
        # Size-1 dims inserted (in order) after k's / v's permute: the batch dims an einsum operand has no
        # subscript for and broadcasts over (multi-query: einsum("bhid,bjd->bhij", q, k), "bhij,bjd->bhid").
        self.k_unsqueeze: list[int] = []
        self.v_unsqueeze: list[int] = []
        self.out_perm = None  # permute of (batch..., Sq, Dv) into the consumer's layout
        # The probabilities' last two dims swapped on their way to ·v, which then reads them as its right
        # operand: v' @ pᵀ, the output (p @ v'ᵀ)ᵀ (timm's MaxViT Attention2d, channels-first v)
        self.probs_swap: Node | None = None
        # masked_fill(p, m, 0) nodes after the softmax, m a condition the scores were masked_fill'ed with
        # (ESPnet / wenet's forward_attention): the op's own zeros at the masked keys (_zeroed_at_mask)
        self.zeroed: list[Node] = []
        # (m, number of probability views seen before it) of each masked_fill(p, m, 0) after the softmax with
        # m constant along the key dim: whole query rows zeroed, which the op's output takes instead
        # (_zeroed_rows; Flamingo's text before any image)
        self.zeroed_rows: list[tuple[Node, int]] = []
        self.batch_dims = 2
        self.variant = "matmul"
        # Leading-dim reshapes seen through, each list ordered outwards from q·kᵀ: on the scores (before
        # the softmax) and on the probabilities (before ·v).
        self.score_views: list[Node] = []
        self.prob_views: list[Node] = []
        # Finite fill values (e.g. finfo.min) the op treats as -inf. They give the same result except on
        # rows where every key is masked: eager averages those uniformly, the op returns 0. Reported.
        self.finite_fills: list[float] = []
        # A -inf fill: on such rows eager's softmax gives NaN and the op 0 (its documented semantics for
        # fully masked rows). Reported where a mask stays (a causal band folded into is_causal has none).
        self.inf_fill = False
        # Whether eager's row with every key masked is uniform (_uniform_masked_rows): the op then gives
        # such a row the mean of v, as eager, where the finite fills are taken as -inf.
        self.uniform_masked_rows = False
        # (split shape, number of terms) of each bias added to the scores viewed with their query / key dims
        # split (_split_score_bias), for the report
        self.split_biases: list[tuple[tuple, int]] = []

    def fold(self, factor):
        if isinstance(factor, tuple):
            self.symbolic_scales.append(factor)
        else:
            self.scale *= factor

    def scale_arg(self, graph: Graph, like: Node):
        """The scale as flash_attention takes it: a float, or a SymFloat node for symbolic factors."""
        scale = self.scale
        for kind, node in self.symbolic_scales:
            fn = operator.mul if kind == "mul" else operator.truediv
            scale = insert_call(graph, fn, (scale, node), like=like)
        return scale


def _casts_probs_like(user: Node, template: Node, softmax: Node) -> bool:
    """`probs.type_as(scores)`: a use of the scores for their dtype only, by a cast in this attention's
    probabilities chain (which the rewrite removes with the rest)."""
    if op_name(user) != "type_as" or len(user.args) < 2 or user.args[1] is not template:
        return False
    node = user.args[0]
    for _ in range(8):
        if node is softmax:
            return True
        if not isinstance(node, Node) or op_name(node) not in _CASTS + _IDENTITY + ("dropout", "dropout_"):
            return False
        node = node.args[0]
    return False


# Factories that take their first argument as a template for shape, dtype and device only.
_LIKE_FACTORIES = ("full_like", "zeros_like", "ones_like", "empty_like", "new_full", "new_zeros", "new_ones",
                   "new_empty")


# Casts that take a tensor as a template for its dtype and device only: ``m.type_as(t)``, ``m.to(t)``.
_TEMPLATE_CASTS = ("type_as", "to")
# Views that take a tensor as a template for its shape only: XLM's / Flaubert's ``mask.expand_as(scores)``
# (review s35 M1: a read of the scores' size, which left the attention with "other users").
_SHAPE_TEMPLATES = ("expand_as",)


def _template_position(node) -> int | None:
    """Where node takes a tensor it reads the metadata of only: a like-factory's first argument (0), a cast's
    template (1: ``mask.type_as(scores)``, Meta's Llama ``mask.type_as(h)``), an expand_as's (1); else
    None."""
    name = op_name(node) if isinstance(node, Node) else None
    return 0 if name in _LIKE_FACTORIES else 1 if name in _TEMPLATE_CASTS + _SHAPE_TEMPLATES else None


def _reads_metadata_only(user: Node, template: Node) -> bool:
    """`torch.full_like(scores, -inf)`, `mask.type_as(scores)`: a use of the scores that never reads their
    values."""
    pos = _template_position(user)
    if pos is None or len(user.args) <= pos or user.args[pos] is not template:
        return False
    reads: list[Node] = []
    torch.fx.node.map_arg((user.args[:pos], user.args[pos + 1:], user.kwargs), reads.append)
    return template not in reads


def _value_inputs(node: Node) -> list[Node]:
    """The nodes whose values node reads: its inputs less a template read for its metadata only."""
    return [a for a in node.all_input_nodes if not _reads_metadata_only(node, a)]


def _fill_value(fill) -> float | None:
    """The value a masking step writes: a constant (number, one-element constant tensor) or a tensor full
    of one (`torch.full_like(scores, -inf)`; the caller checks that it does not enlarge the scores)."""
    value = _const_scalar(fill)
    if value is None and op_name(fill) == "full_like":
        value = _const_scalar(arg(fill, 1, "fill_value"))
    if value is not None and math.isnan(value):
        return None  # NaN masks nothing: eager's softmax gives NaN on every row it reaches
    return value


def _unknown_fill(fill) -> str:
    """Why a fill's value is unknown, for the report: a value read from a graph input (a registered buffer,
    old GPT-2's and the Decision Transformer's ``self.masked_bias.to(w.dtype)``) is not read at compile
    time, as masks from graph inputs are not: it may change between calls with no recompile."""
    node = fill
    passthrough = _CASTS + _IDENTITY + _RESHAPES
    while isinstance(node, Node) and node.op != "placeholder" and op_name(node) in passthrough:
        node = node.args[0]
    if isinstance(node, Node) and node.op == "placeholder":
        return (f" (it is read from the graph input '{node.name}', a buffer or parameter whose value may "
                "change between calls)")
    return ""


def _over_last_dim_keepdim(node: Node, ndim: int) -> bool:
    """Whether a reduction node reduces the last dim only, keeping it (``dim=-1, keepdim=True``, or NumPy's
    ``axis=`` / ``keepdims=``, which torch takes too): a result that broadcasts back along that dim alone.
    Without keepdim the (..., Sq) result would broadcast against the key dim instead."""
    dim = arg(node, 1, "dim", node.kwargs.get("axis"))
    keepdim = arg(node, 2, "keepdim", node.kwargs.get("keepdims", False))
    return norm_dim(dim, ndim) == ndim - 1 and keepdim is True


def _row_max_nodes(node, x: Node) -> list[Node] | None:
    """The nodes of `x.amax(-1, keepdim=True)` (or `x.max(-1, keepdim=True).values` / `[0]`, detached or
    not) when node is that row max of x, outermost first; else None. Who else reads them is the caller's
    to check."""
    chain = []
    while isinstance(node, Node) and op_name(node) == "detach":
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, Node):
        return None
    if op_name(node) == "getitem" and node.args[1] == 0 or (
        node.op == "call_function" and node.target is getattr and node.args[1] == "values"
    ):
        chain.append(node)
        node = node.args[0]
        if op_name(node) != "max":
            return None
    elif op_name(node) != "amax":
        return None
    chain.append(node)
    shape = _shape(x)
    if node.args[0] is not x or shape is None or not _over_last_dim_keepdim(node, len(shape)):
        return None
    return chain


def _row_max_of(node, x: Node, consumer: Node) -> list[Node] | None:
    """The nodes of x's row max (_row_max_nodes) when node is that and is used by consumer only, outermost
    first; else None.

    softmax(x - c) == softmax(x) for any finite c constant along the key dim, and a row max is finite
    unless the row is entirely -inf (every key masked: the documented case where the op returns 0).
    Other reductions are not taken: a row min or mean is -inf as soon as one key is masked.
    """
    chain = _row_max_nodes(node, x)
    if chain is None or any(
        not _single_user(n, user) for n, user in zip(chain, [consumer] + chain[:-1], strict=True)
    ):
        return None
    return chain


def _same_value(a, b, copies: list[Node], depth: int = 12) -> bool:
    """Whether b computes the value a does: the same node, or the same deterministic op on arguments of
    the same values. Dynamo records an expression as often as the source writes it
    (``torch.exp(s) / torch.exp(s).sum(-1, keepdim=True)`` holds two exp nodes), and no CSE runs before
    the passes. b's nodes that are not a's are appended to copies (the caller checks their other users).
    A node written in place is never taken as its own copy: which value a read sees depends on where it
    runs."""
    if isinstance(a, Node) or isinstance(b, Node):
        if a is b:
            return not in_place_writers(a)
        if not (isinstance(a, Node) and isinstance(b, Node)) or depth == 0:
            return False
        if (
            a.op != b.op
            or a.op not in ("call_function", "call_method")
            or a.target != b.target
            or is_in_place(a)
            or any(r in str(op_name(a) or a.target) for r in _RANDOM_OPS)
            or a.kwargs.keys() != b.kwargs.keys()
            or len(a.args) != len(b.args)
            or (_shape(a), _dtype(a)) != (_shape(b), _dtype(b))
        ):
            return False
        pairs = [*zip(a.args, b.args, strict=True), *((a.kwargs[key], b.kwargs[key]) for key in a.kwargs)]
        if not all(_same_value(x, y, copies, depth - 1) for x, y in pairs):
            return False
        copies.append(b)
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(
            _same_value(x, y, copies, depth) for x, y in zip(a, b, strict=True))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare (symbolic) are not proven equal
        return False


def _exp_limits(dtype) -> str:
    """Where eager's exp of unshifted scores leaves dtype's range: exp(s) is inf past log(max), and a row
    whose scores all fall below log(smallest subnormal) sums to 0."""
    finfo = torch.finfo(dtype)
    return (f"past {math.log(finfo.max):.4g} in {dtype}, and its row sum is 0 when every score of a row is "
            f"below {math.log(finfo.smallest_normal * finfo.eps):.4g}")


def _reciprocal_of(node) -> object | None:
    """d when node is 1 / d by any spelling: ``1 / d`` (``torch.div(1, d)``), ``d.reciprocal()``
    (``torch.reciprocal(d)``), ``d ** -1``; else None. Whether d is a softmax's denominator is the caller's
    to check."""
    if not isinstance(node, Node):
        return None
    name = op_name(node)
    if name == "reciprocal" and len(node.args) == 1 and not node.kwargs:  # (out= writes elsewhere)
        return node.args[0]
    pair = _operands(node) if name in ("div", "pow") and _plain_binary(node) else None
    if pair is None:
        return None
    if name == "div" and _const_scalar(pair[0]) == 1:
        return pair[1]
    if name == "pow" and is_number(pair[1]) and pair[1] == -1:
        return pair[0]
    return None


def _written_out_parts(node) -> tuple[Node, object, Node | None] | None:
    """(numerator, denominator, reciprocal) when node divides an exp by something, ``exp(..) / d``, or
    multiplies it by something's reciprocal (_reciprocal_of), ``exp(..) * (1 / d)`` in either order
    (reciprocal: that 1 / d node, None for the division); else None. The shape of a written-out softmax
    only: _written_out_softmax proves the rest."""
    name = op_name(node)
    pair = _operands(node) if name in ("div", "mul") else None
    if pair is None:
        return None
    if name == "div":
        return (pair[0], pair[1], None) if op_name(pair[0]) == "exp" else None
    for num, recip in (pair, pair[::-1]):
        den = _reciprocal_of(recip)
        if op_name(num) == "exp" and den is not None:
            return num, den, recip
    return None


def _written_out_softmax(node: Node) -> tuple[Node, list[Node]]:
    """(x, nodes) when node is softmax(x) over the last dim written out,
    ``e = torch.exp(x - x.amax(-1, keepdim=True)); e / e.sum(-1, keepdim=True)`` (the row max by any
    spelling _row_max_nodes takes, each expression written once or repeated), or the same with the division
    written as a multiplication by the sum's reciprocal, ``e * (1 / e.sum(-1, keepdim=True))``,
    ``e * e.sum(-1, keepdim=True).reciprocal()`` (_reciprocal_of): nodes are the ones it is made of, node
    aside. Else raise with the reason.

    This is what F.softmax computes, step for step: exp of the scores shifted by their row max (each at
    most 1, the largest exactly 1), over its sum along the same dim (between 1 and Sk). Exactly that
    is taken. The reciprocal form rounds once more (1 / sum, then the product): the same function, rounded
    differently, as the op's own arithmetic is; 1 / sum is in [1 / Sk, 1], never past the dtype's range.
    Without the shift it is softmax only in exact arithmetic: eager's exp overflows once a
    score passes log(finfo.max) (88.7 in float32 and bfloat16, 11.1 in float16: reachable logits) and
    its row sum underflows to 0 when every score of a row is very negative, NaN either way, where the op
    is finite. The op's -inf-row convention concerns rows with no visible key, a degenerate input; these
    are ordinary ones, so the unshifted form is left to eager, reported (as the norm pass leaves float16
    statistics that overflow where the fused op does not). A shift by anything else (another tensor's
    max, a max over another dim or without keepdim) or a denominator that is not that sum (``+ eps``,
    another dim, another tensor) is another function: reported."""
    parts = _written_out_parts(node)
    if parts is None or not _plain_binary(node):
        verb = "divides" if op_name(node) == "div" else "multiplies"
        raise _Skip(f"'{node.name}' {verb} with {dict(node.kwargs)}")
    num, den, recip = parts
    shape = _shape(num)
    what = "multiplies exp(..) by the reciprocal of" if recip is not None else "divides exp(..) by"
    if not isinstance(arg(num, 0, "input"), Node) or shape is None:
        raise _Skip(f"'{node.name}' does not divide exp of a tensor")
    if not _same_dims(_shape(node) or (), shape) or _dtype(node) != _dtype(num):
        # a numerator 1 of more dims or a wider dtype (torch.ones(1, 1, 1, 1, 1, dtype=torch.float64) / ..)
        raise _Skip(f"'{node.name}' brings exp(..) {list(shape)} ({_dtype(num)}) to "
                    f"{list(_shape(node) or [])} ({_dtype(node)})")
    if not isinstance(den, Node) or op_name(den) != "sum" or not isinstance(den.args[0], Node):
        raise _Skip(f"'{node.name}' {what} '{getattr(den, 'name', den)}', not by its sum over the "
                    "key dim")
    if not _over_last_dim_keepdim(den, len(shape)):
        raise _Skip(f"the denominator '{den.name}' is not a sum over the last (key) dim with keepdim=True")
    if arg(den, 3, "dtype") not in (None, _dtype(num)):
        raise _Skip(f"the denominator '{den.name}' is summed in {arg(den, 3, 'dtype')}")
    nodes = [num, den] + ([recip] if recip is not None else [])
    if not _same_value(num, den.args[0], nodes):
        raise _Skip(f"the denominator '{den.name}' sums '{den.args[0].name}', not the numerator "
                    f"'{num.name}' (nor the same expression)")
    shifted = arg(num, 0, "input")
    if op_name(shifted) == "sub" and _plain_binary(shifted):
        x, shift = _operands(shifted)
        row_max = _row_max_nodes(shift, x) if isinstance(x, Node) else None
        if row_max is None:
            what = getattr(shift, "name", shift)
            raise _Skip(f"the written-out softmax subtracts '{what}' before exp: not the row max of "
                        f"'{getattr(x, 'name', x)}' over the key dim with keepdim=True")
        nodes += [shifted, *row_max]
    else:
        raise _Skip(f"the written-out softmax takes exp of '{shifted.name}' without subtracting its row max: "
                    f"eager's exp overflows {_exp_limits(_dtype(num))}: NaN where the op is finite")
    _only_read_inside(node, nodes, "written-out softmax")
    if _dtype(den) == torch.float16 and not _holds(shape[-1] <= torch.finfo(torch.float16).max):
        # the sum of Sk terms of at most 1 stays finite in float16 only up to 65504 keys
        raise _Skip(f"the float16 denominator sums {shape[-1]} keys: it may overflow past 65504")
    return x, nodes


def _only_read_inside(root: Node, nodes: list[Node], what: str):
    """Raise unless every node of a softmax written out (root and nodes) is read by the others only."""
    pattern = {root, *nodes}
    for n in nodes:
        others = [u.name for u in n.users if u not in pattern]
        if others:
            raise _Skip(f"intermediate '{n.name}' of the {what} has other users ({', '.join(others)})")


def _logsumexp_of(exp: Node) -> Node | None:
    """The logsumexp node when exp is ``exp(s - logsumexp(s, dim, keepdim))`` (torch.exp or .exp() of a
    subtraction of torch.logsumexp, .logsumexp or torch.special.logsumexp), else None: the shape of it only,
    _logsumexp_softmax proves the rest."""
    if op_name(exp) != "exp" or set(exp.kwargs) - {"input"}:  # torch.exp(.., out=buf) writes elsewhere
        return None
    shifted = arg(exp, 0, "input")
    pair = _operands(shifted) if op_name(shifted) == "sub" else None
    lse = pair[1] if pair is not None else None
    if isinstance(lse, Node) and (op_name(lse) == "logsumexp" or lse.op == "call_function"
                                  and lse.target is torch.special.logsumexp):
        return lse
    return None


def _logsumexp_softmax(exp: Node) -> tuple[Node, list[Node]]:
    """(x, nodes) when exp is softmax(x) over the last dim written as ``torch.exp(x - torch.logsumexp(x,
    dim=-1, keepdim=True))`` (the logsumexp by any spelling, of x or of the same expression written again):
    nodes are the ones it is made of, exp aside. Else raise with the reason.

    That is exp(log_softmax(x)) with log_softmax's own steps: logsumexp shifts by the row max before its
    exp (it never overflows: an all -inf row gives -inf, a row with +inf gives +inf), and x - logsumexp(x)
    is at most ~0, so exp never overflows either. The same values as softmax up to rounding, NaN on the
    same rows (every score -inf, or NaN), as _log_softmax_of's form. A logsumexp over another dim, without
    keepdim (the (.., Sq) result broadcast against the key dim), of another tensor, or a subtraction with
    alpha is another function: reported."""
    shifted = arg(exp, 0, "input")
    lse = _logsumexp_of(exp)
    extra = {key: value for key, value in _extra_kwargs(shifted).items()
             if value is not None and not (key == "alpha" and value == 1)}
    if extra:
        raise _Skip(f"'{shifted.name}' subtracts the logsumexp with {extra}: the logsumexp would be scaled")
    x = _operands(shifted)[0]
    shape = _shape(x) if isinstance(x, Node) else None
    if shape is None:
        raise _Skip(f"'{shifted.name}' subtracts the logsumexp from something that is not a tensor")
    if set(lse.kwargs) - {"input", "dim", "keepdim"} or not _over_last_dim_keepdim(lse, len(shape)):
        raise _Skip(f"the logsumexp '{lse.name}' is not over the last (key) dim with keepdim=True "
                    f"(dim={arg(lse, 1, 'dim')}, keepdim={arg(lse, 2, 'keepdim', False)})")
    nodes = [shifted, lse]
    source = arg(lse, 0, "input")
    if not _same_value(x, source, nodes):
        raise _Skip(f"the logsumexp '{lse.name}' is of '{getattr(source, 'name', source)}', not of the "
                    f"scores '{x.name}' it is subtracted from (nor the same expression)")
    _only_read_inside(exp, nodes, "softmax written as exp(s - logsumexp(s))")
    return x, nodes


def _row_scale_operand(node: Node) -> tuple[Node, str, Node]:
    """(scores, "mul" | "div", t) for scores * t or scores / t with t a runtime tensor constant along the
    key dim: a 0-d temperature, a learned per-head scale (H, 1, 1) (Swin V2's logit_scale), a per-query
    one. Then scores·t = (q·t)·kᵀ exactly, so t moves onto q (the rewrite checks that it fits q). Else
    raise: a factor that varies along the keys, or one that is not a tensor."""
    operands = _operands(node) if _plain_binary(node) else None
    pairs = [] if operands is None else [operands] if op_name(node) == "div" else [operands, operands[::-1]]
    for scores, t in pairs:
        shape = _shape(t)
        if (
            isinstance(scores, Node)
            and isinstance(t, Node)
            and _reaches_matmul(scores)
            and not _reaches_matmul(t)
            and shape is not None
            and (not shape or _holds(shape[-1] == 1))
            and _dtype(t).is_floating_point
            and _dtype(node) == _dtype(scores)
            and _same_dims(_shape(node), _shape(scores))
        ):
            return scores, op_name(node), t
    raise _Skip(f"scores are scaled by '{node.name}', which is not a compile-time constant, nor a tensor "
                "constant along the key dim that keeps the scores' shape and dtype")


def _check_finite_shift(node: Node, number):
    """A number added to or subtracted from every score is a shift softmax ignores only when it is finite
    and small: ``s + float("-inf")`` makes every score -inf and ``s - nan`` every score NaN (eager's softmax:
    NaN on every row), and a shift as large as a mask fill (``s - 1e9``) rounds the scores away (eager: the
    uniform average of v), none of which the op, without the shift, gives (review s27)."""
    if isinstance(number, complex) or not math.isfinite(number) or abs(number) >= -_MASKED_VALUE:
        raise _Skip(f"'{node.name}' shifts every score by {number}: not a small finite constant, so not a "
                    "shift that leaves softmax unchanged")


def _promoted_mask(cand: _Candidate, step: Node, scores: Node, mask: Node):
    """Record the conversion of an integer or bool mask added to (or subtracted from) float scores.

    Type promotion makes ``s + m`` a tensor of the scores' dtype (a float beats any integer, whatever the
    dims), and TensorIterator converts m's elements to that dtype before it adds: s + m.to(s.dtype), bit
    for bit, so the op takes m.to(s.dtype). Any other mix (a float mask of another dtype is the caller's
    as before; a complex one, or float scores that would not be the result dtype) is not converted here."""
    meta = tensor_meta(mask)
    if meta is None or meta.dtype.is_floating_point:
        return  # not a tensor (Masks.check says so), or a float mask (taken as it is)
    result, source = _dtype(step), _dtype(scores)
    if meta.dtype.is_complex or result is None or not result.is_floating_point or result != source:
        raise _Skip(f"'{step.name}' combines {source} scores with a {meta.dtype} mask into {result}: not a "
                    "promotion of the mask to the scores' dtype")
    cand.masks.casts[mask] = result


def _multiplicative_keep(cand: _Candidate, node: Node, form) -> tuple[Node, Node, float]:
    """Take ``scores * b - c * (1 - b)`` (node; form: _multiplicative_mask's) as a keep mask b with fill -c,
    as ``torch.where(b == 1, scores, -c)`` / ``masked_fill(b == 0, -c)`` are taken; return (scores, b, the
    fill as written). Else raise with the reason.

    Where b is 1 it is scores * 1 - c * 0 = scores, where b is 0 it is scores * 0 - c = -c (c rounded to
    the dtype, as eager's c * (1 - b) is), exactly, for finite scores. So it is a mask only when b holds 0 and
    1 alone: proven (_zero_one) for a bool converted to float or a tril of ones built in the graph, never for
    a runtime float tensor. Old GPT-2's registered float buffer is one (dynamo passes buffers as graph inputs,
    whose values may be anything at run time): left to eager, reported. A score that is inf or NaN where b
    is 0 gives NaN (inf * 0) in eager and is masked out by the op, as by masked_fill: the scores of q·kᵀ
    are finite in these models, the same assumption as the finite fills'."""
    scores, mask, again, product, fill = form
    if not _same_value(mask, again, []):
        raise _Skip(f"'{node.name}' multiplies the scores by '{mask.name}' but subtracts a multiple of 1 - "
                    f"'{again.name}': not the same mask")
    # c is multiplied in float32 at least (half-precision tensors compute in float32): past its range it is
    # inf there, and inf * (1 - 1) NaN where b is 1
    if not abs(fill) <= torch.finfo(torch.float32).max or fill > _MASKED_VALUE:
        raise _Skip(f"'{node.name}' (scores * b - c * (1 - b)) fills {fill:.3g} where b is 0: not a finite "
                    "large negative constant")
    others = [u.name for u in product.users if u is not node]
    if others:
        raise _Skip(f"intermediate '{product.name}' has other users ({', '.join(others)})")
    if not _same_dims(_shape(node) or (), _shape(scores) or ()):
        raise _Skip(f"'{node.name}' broadcasts the scores {list(_shape(scores) or [])} to "
                    f"{list(_shape(node) or [])}")
    dtypes = {_dtype(n) for n in (node, product, scores, mask)}
    if len(dtypes) != 1:
        raise _Skip(f"'{node.name}' (scores * b - c * (1 - b)) mixes dtypes {sorted(map(str, dtypes))}: "
                    "the mask would change the scores' dtype")
    if not _zero_one(mask):
        raise _Skip(f"the scores are scaled by '{mask.name}' in '{node.name}' (scores * b - c * (1 - b)): a "
                    f"mask only where b holds 0 and 1 alone, not proven of '{mask.name}' (a runtime float "
                    "tensor, a registered buffer, may hold anything; a bool converted to float, or a tril of "
                    "ones built in the graph, is proven)")
    cand.chain.append(product)
    # the value eager leaves where b is 0: c * (1 - 0) in the dtype, subtracted from scores * 0
    value = float(torch.tensor(fill, dtype=torch.float64).to(_dtype(node)))
    if math.isfinite(value):
        cand.finite_fills.append(value)
    else:
        cand.inf_fill = True  # c past the dtype's range (1e10 in float16): -inf
    cand.masks.keeps.append((mask, False))
    cand.masks.zero_one.add(mask)
    cand.masks.stages[mask] = _shape(scores)
    return scores, mask, fill


def _plain_add(node) -> tuple | None:
    """The operands of ``a + b`` (operator.add, torch.add, Tensor.add; functionalize_in_place has turned
    ``+=`` and ``add_`` on the fresh split scores into these), with no alpha or out, else None."""
    if op_name(node) != "add" or _operands(node) is None:
        return None
    extra = {k: v for k, v in _extra_kwargs(node).items() if v is not None and not (k == "alpha" and v == 1)}
    return None if extra else _operands(node)


def _reshapes_of(node, shape, depth: int = 4) -> tuple[Node, list[Node]] | None:
    """(source, the reshapes from node down) when node is one or a few row-major reshapes (_RESHAPES, each
    read only by the next, none reinterpreting the dtype) of a tensor of the given shape, else None."""
    views: list[Node] = []
    while op_name(node) in _RESHAPES and node.args and isinstance(node.args[0], Node) and len(views) < depth:
        source = node.args[0]
        if _dtype(source) != _dtype(node) or views and len(node.users) != 1:
            return None
        views.append(node)
        if _same_dims(_shape(source) or (), shape):
            return source, views
        node = source
    return None


def _leads_to_split(node, scores_shape, depth: int = 16) -> bool:
    """Whether node is, through plain additions, reshapes of a tensor of the scores' shape: the scores' side
    of each addition between a split and its merge (_split_score_bias)."""
    if not isinstance(node, Node) or depth == 0:
        return False
    if _reshapes_of(node, scores_shape) is not None:
        return True
    pair = _plain_add(node)
    return pair is not None and any(_leads_to_split(a, scores_shape, depth - 1) for a in pair)


def _query_key_factors(split_shape, scores_shape) -> int | None:
    """How many of the split dims after the scores' leading dims are query factors (their product Sq, the
    rest's Sk), or None when the split changes the leading dims or mixes query and key positions."""
    lead = len(scores_shape) - 2
    if len(split_shape) < lead + 2 or not _same_dims(split_shape[:lead], scores_shape[:lead]):
        return None
    sq, sk = scores_shape[-2:]
    factors = split_shape[lead:]
    try:  # on the example's sizes first, so that only the split taken adds guards
        hinted, hq, hk = [_hint(d) for d in factors], _hint(sq), _hint(sk)
    except _Skip:
        return None
    for n in range(len(factors) + 1):
        if _prod(hinted[:n]) == hq and _prod(hinted[n:]) == hk:
            ok = _holds(_prod(factors[:n]) == sq) and _holds(_prod(factors[n:]) == sk)
            return n if ok else None
    return None


def _split_score_bias(cand: _Candidate, merge: Node, refused: _Skip) -> tuple[Node, Node]:
    """SAM / ViTDet / MViTv2's decomposed relative positions: the scores s (..., Sq, Sk) viewed with Sq and Sk
    split into factors, bias terms added that broadcast to that shape, and merged back::

        attn = (attn.view(B, q_h, q_w, k_h, k_w) + rel_h[:, :, :, :, None] + rel_w[:, :, :, None, :]
                ).view(B, q_h * q_w, k_h * k_w)

    merge(split(s) + b1 + ... + bn) is s + merge(expand(b1 + ... + bn)): a row-major view or reshape is a
    fixed bijection of the logical indices, whatever the strides (a reshape that copies gives the same
    values), the same for both summands of same-shaped tensors, and a merge back to s's own shape inverts
    the split. So the terms' sum, expanded to the split shape and merged to (..., Sq, Sk), is an additive
    mask the op takes, with its gradient (SAM's terms depend on q and on the learned tables rel_pos_h /
    rel_pos_w). Only the terms' sum rounds differently from eager's additions onto the scores one by one,
    as two additive masks summed by _Masks.build do.

    Taken only when it is provably that: the split keeps the scores' leading dims and splits Sq and Sk each
    into factors of its own (the bias is then a function of the query and the key position); each step
    between the split and the merge is an addition (operands either way round, no alpha) of a tensor in the
    scores' dtype that keeps the split shape (each term broadcasts to it without enlarging it); the merge
    gives s's shape back; no intermediate has another reader. Split and merge may each be a few reshapes.
    Anything else raises with its reason; a reshape with no addition under it raises `refused`
    (_check_leading_reshape's reason). Returns (the innermost split view, s). The mask is inserted into the
    graph now, for the mask checks that follow, and erased with the rest of the attempt if it is refused
    later (_rewrite_softmax)."""
    merges = [merge]
    while merges[-1].args and op_name(merges[-1].args[0]) in _RESHAPES and merges[-1].args[0].args \
            and _dtype(merges[-1].args[0]) == _dtype(merge):
        merges.append(merges[-1].args[0])
    inner = merges[-1].args[0]
    if _plain_add(inner) is None or _dtype(inner) != _dtype(merge) or _shape(merge) is None:
        raise refused
    scores_shape, split_shape = _shape(merge), _shape(inner)
    adds, terms = [], []
    x, consumer = inner, merges[-1]
    for node, reader in zip(merges[1:], merges, strict=False):
        if set(node.users) != {reader}:
            raise _Skip(f"intermediate '{node.name}' has other users")
    while True:
        others = [u.name for u in x.users if u is not consumer]
        if others:
            raise _Skip(f"intermediate '{x.name}' has other users ({', '.join(others)})")
        pair = _plain_add(x)
        if pair is None:
            break
        sides = [_leads_to_split(a, scores_shape) for a in pair]
        if all(sides):
            raise _Skip(f"cannot tell the split scores from the bias in '{x.name}'")
        if not any(sides):  # the scores reach these additions through another step: name it
            while pair is not None:
                reaching = [a for a in pair if _reaches_matmul(a)]
                if len(reaching) != 1:
                    raise _Skip(f"cannot tell the split scores from the bias in '{x.name}'")
                x = reaching[0]
                pair = _plain_add(x)
            break
        scores, term = pair if sides[0] else pair[::-1]
        if not isinstance(term, Node) or tensor_meta(term) is None:
            raise _Skip(f"'{x.name}' adds {term} to the split scores: only tensor bias terms are taken")
        # (each sum keeps its scores operand's shape and dtype, so all keep the split view's)
        if not _same_dims(_shape(x) or (), _shape(scores) or ()):
            raise _Skip(f"the bias term '{term.name}' {list(_shape(term) or [])} of '{x.name}' does not "
                        f"broadcast to the split scores {list(_shape(scores) or [])} without enlarging them")
        if not (_dtype(term) == _dtype(x) == _dtype(scores)):
            raise _Skip(f"the bias term '{term.name}' ({_dtype(term)}) of '{x.name}' is not in the split "
                        f"scores' dtype ({_dtype(scores)})")
        adds.append(x)
        terms.insert(0, term)  # innermost first: the order eager adds them in
        consumer, x = x, scores
    found = _reshapes_of(x, scores_shape)
    if found is None and op_name(x) in _RESHAPES:
        raise _Skip(f"'{merge.name}' merges the scores split by '{x.name}' into {list(scores_shape)}, a "
                    "shape they do not have under the split: only a merge that gives the scores' own shape "
                    "back is seen through")
    if found is None:
        raise _Skip(f"the scores reach '{merge.name}', which merges their split query / key dims back, "
                    f"through '{x.name}' ({op_name(x) or x.target}): between the split and the merge only "
                    "additions of bias terms are seen through")
    scores, splits = found
    n_query = _query_key_factors(split_shape, scores_shape)
    if n_query is None:
        raise _Skip(f"'{splits[0].name}' views the scores {list(scores_shape)} as {list(split_shape)}: not a "
                    "split of the query and of the key dim each into factors of its own, the leading dims "
                    "kept")
    cand.chain.extend([*merges[1:], *adds, *splits])
    mask = _merged_bias(merge.graph, terms, split_shape, n_query, len(scores_shape) - 2, merge)
    cand.masks.additive.append(mask)
    cand.masks.stages[mask] = scores_shape
    cand.split_biases.append((split_shape, len(terms)))
    return splits[-1], scores


def _merged_bias(graph: Graph, terms: list[Node], split_shape, n_query: int, n_lead: int, like: Node) -> Node:
    """The bias terms of _split_score_bias summed, expanded where a group of query (key) factors is broadcast
    over some of them only, and merged to (..., Sq or 1, Sk or 1). Its leading dims stay the terms' own
    (broadcast ones too): a bias with no batch dim reaches the op without one."""
    total = terms[0]
    for term in terms[1:]:
        total = insert_call(graph, torch.add, (total, term), like=like)
    groups = len(split_shape) - n_lead  # the query and the key factors
    while _shape(total) is not None and len(_shape(total)) < groups:
        total = insert_call(graph, torch.unsqueeze, (total, 0), like=like)
    shape = _shape(total)
    if shape is None:
        raise _Skip("the bias terms' sum has no shape information")
    first = len(shape) - groups  # where the query factors start in the sum
    sizes: list = [-1] * len(shape)
    for lo, hi in ((first, first + n_query), (first + n_query, len(shape))):
        if all(_holds(d == 1) for d in shape[lo:hi]):
            continue  # the whole group broadcast: one value for every query (key) position
        for i in range(lo, hi):
            target = split_shape[i - first + n_lead]
            if _holds(shape[i] == target):
                continue
            if not isinstance(target, int):
                raise _Skip(f"a bias term of the split scores {list(split_shape)} is broadcast over some of "
                            "the query or key factors only; expanding it needs static sizes")
            sizes[i] = target
    if any(s != -1 for s in sizes):
        total = insert_call(graph, torch.Tensor.expand, (total, tuple(sizes)), like=like)
    key_at, n_key = first + n_query, groups - n_query
    if n_key != 1:  # none (Sk = 1): a dim of 1; several: merged row-major, as the merge does
        total = insert_call(graph, torch.unsqueeze, (total, key_at), like=like) if n_key == 0 else \
            insert_call(graph, torch.flatten, (total, key_at, key_at + n_key - 1), like=like)
    if n_query != 1:
        total = insert_call(graph, torch.unsqueeze, (total, first), like=like) if n_query == 0 else \
            insert_call(graph, torch.flatten, (total, first, first + n_query - 1), like=like)
    return total


def _unexpanded_mask(cand: _Candidate, cond, step: Node, scores: Node):
    """XLM's / Flaubert's ``scores.masked_fill_((mask == 0).view(..).expand_as(scores), min)``: a mask (a
    condition, or an additive mask) brought to the scores' shape by an expand_as of these very scores, and
    read by this step only, is taken as its source (review s35 M1). masked_fill, torch.where, + and -
    broadcast the source to the scores as the expand_as did, so the step is the same function; the
    expand_as, a read of the scores' size, is erased with the pattern (_scores_side lets no other one
    through: it would keep q·kᵀ computed beside the op)."""
    if (isinstance(cond, Node) and op_name(cond) == "expand_as" and len(cond.args) == 2 and not cond.kwargs
            and cond.args[1] is scores and isinstance(cond.args[0], Node)
            and tensor_meta(cond.args[0]) is not None and set(cond.users) == {step}
            and not _reaches_matmul(cond.args[0])):  # a mask, not a shift computed from the scores
        cand.chain.append(cond)
        return cond.args[0]
    return cond


def _scores_side(cand: _Candidate, softmax: Node, x: Node, softmax_nodes=()):
    """Walk from the softmax input down to q·kᵀ, collecting scales, masks and casts. softmax_nodes: the
    nodes of a written-out softmax, which read its input (the row max and the shift)."""
    consumer = softmax
    steps: list[tuple[str, object]] = []
    fills: dict[int, float] = {}  # a keep step's fill value, by step index
    multiplied: list[int] = []  # the steps that are multiplicative masks (scores * b - c * (1 - b))
    # the row max of a `scores - scores.amax(-1, keepdim=True)` step, and a written-out softmax's own reads
    side_reads: set[Node] = set(softmax_nodes)
    while True:
        if not isinstance(x, Node):
            raise _Skip("softmax input is not a tensor")
        others = [
            u.name
            for u in x.users
            if u is not consumer
            and u not in side_reads
            and not _casts_probs_like(u, x, softmax)
            # an expand_as of the scores reads their size only, but is taken only as a mask's, peeled
            # (_unexpanded_mask): another one would keep q·kᵀ computed for its template
            and not (_reads_metadata_only(u, x) and (op_name(u) not in _SHAPE_TEMPLATES or u in cand.chain))
        ]
        if others:
            raise _Skip(f"intermediate '{x.name}' has other users ({', '.join(others)})")
        name = op_name(x)
        if name in _SCORE_MATMULS:
            break
        cand.chain.append(x)
        if name in _CASTS or name in _IDENTITY:
            if _shape(x) != _shape(x.args[0]):
                raise _Skip(f"'{x.name}' changes the scores' shape")
            steps.append(("cast", x))
            consumer, x = x, x.args[0]
            continue
        if name in _RESHAPES and isinstance(x.args[0], Node):
            try:
                _check_leading_reshape(x, "scores")
            except _Skip as refused:
                # unless it merges back a split of the query / key dims that bias terms were added to
                split, scores = _split_score_bias(cand, x, refused)
                steps.append(("add", cand.masks.additive[-1]))
                consumer, x = split, scores
                continue
            cand.score_views.insert(0, x)
            consumer, x = x, x.args[0]
            continue
        if name in ("mul", "div"):
            scaled = _scale_operand(x)
            if scaled is None:
                scores, kind, factor = _row_scale_operand(x)
                steps.append(("tensor scale", factor))
                cand.q_scales.append((kind, factor, _shape(scores)))
                consumer, x = x, scores
                continue
            if not _reaches_matmul(scaled[0]):
                raise _Skip(f"'{x.name}' does not scale the q·kᵀ scores")
            if not _same_dims(_shape(x) or (), _shape(scaled[0]) or ()):
                # a one-element constant of more dims than the scores adds leading dims (scores * t[None])
                raise _Skip(f"'{x.name}' broadcasts the scores {list(_shape(scaled[0]) or [])} to "
                            f"{list(_shape(x) or [])}")
            if isinstance(scaled[1], tuple):
                steps.append(("symbolic scale", scaled[1]))
            elif scaled[1] <= 0 or not math.isfinite(scaled[1]):
                raise _Skip(f"scale {scaled[1]} is not a positive finite number")
            else:
                steps.append(("scale", scaled[1]))
            cand.fold(scaled[1])
            consumer, x = x, scaled[0]
            continue
        multiplicative = _multiplicative_mask(x)
        if multiplicative is not None:
            scores, mask, value = _multiplicative_keep(cand, x, multiplicative)
            fills[len(steps)] = value
            multiplied.append(len(steps))
            steps.append(("keep", mask))
            consumer, x = multiplicative[3], scores
            continue
        if name == "add" and _operands(x) is not None:
            a, b = _operands(x)
            ra, rb = _reaches_matmul(a), _reaches_matmul(b)
            if ra and rb:
                ra, rb = _residual_scores_operands(x, a, b)
            if ra == rb:
                raise _Skip(f"cannot tell the scores from the mask in '{x.name}'")
            alpha = x.kwargs.get("alpha", 1)
            if alpha != 1 or _extra_kwargs(x).keys() - {"alpha"}:
                # torch.add(a, b, alpha=c) is a + c·b: the mask scaled (s + m·c), or the scores (m + s·c)
                raise _Skip(f"'{x.name}' adds with alpha={alpha}: the mask or the scores would be scaled")
            scores, mask = (a, b) if ra else (b, a)
            mask = _unexpanded_mask(cand, mask, x, scores)
            if is_number(mask):
                _check_finite_shift(x, mask)
                steps.append(("shift", mask))  # a constant shift does not change softmax
            else:
                if mask in cand.masks.negated:  # masks are kept by node: s + m - m would give s - 2m
                    raise _Skip(f"'{mask.name}' is both added to and subtracted from the scores")
                _promoted_mask(cand, x, scores, mask)
                steps.append(("add", mask))
                cand.masks.additive.append(mask)
                cand.masks.stages[mask] = _shape(scores)  # the scores' shape, not the (maybe broadcast) sum
            consumer, x = x, scores
            continue
        if name == "sub" and _operands(x) is not None and isinstance(_operands(x)[0], Node):
            scores, shift = _operands(x)
            extra = {key: value for key, value in _extra_kwargs(x).items()
                     if value is not None and not (key == "alpha" and value == 1)}
            if extra:
                # torch.sub(s, c, alpha=a) is s - a·c: a shift of 1 by alpha=1e9 rounds the scores away
                # (rewritten before, review s28), and a·m is not the mask m
                raise _Skip(f"'{x.name}' subtracts with {extra}: the subtrahend would be scaled")
            shift = _unexpanded_mask(cand, shift, x, scores)
            row_max = _row_max_of(shift, scores, x)
            if (
                row_max is None
                and isinstance(shift, Node)
                and tensor_meta(shift) is not None
                and _reaches_matmul(scores)
                and not _reaches_matmul(shift)
                # a shift computed from the scores (s.amin(-2)) is no mask; a peeled expand_as reads the size
                and all(u is x or (op_name(u) in _SHAPE_TEMPLATES and u in cand.chain) for u in scores.users)
            ):
                # s - m is s + (-m), exactly: an additive mask the op takes negated (XLNet's s - 1e30·m)
                if any(n is shift for n in cand.masks.additive):
                    raise _Skip(f"'{shift.name}' is both added to and subtracted from the scores")
                _promoted_mask(cand, x, scores, shift)
                steps.append(("sub", shift))
                cand.masks.additive.append(shift)
                cand.masks.negated.add(shift)
                cand.masks.stages[shift] = _shape(scores)
                consumer, x = x, scores
                continue
            if not is_number(shift) and row_max is None:
                what = getattr(shift, "name", shift)
                raise _Skip(f"'{x.name}' subtracts '{what}' from the scores: neither a constant nor their "
                            "row max over the key dim (used there only)")
            if row_max is None:
                _check_finite_shift(x, shift)
            steps.append(("shift", shift))  # a per-row constant does not change softmax
            if row_max is not None:
                cand.chain.extend(row_max)
                side_reads.add(row_max[-1])
            consumer, x = x, scores
            continue
        if name in ("masked_fill", "masked_fill_"):
            cond, fill, scores = arg(x, 1, "mask"), arg(x, 2, "value"), arg(x, 0, "input")
            cond = _unexpanded_mask(cand, cond, x, scores)
            value = _fill_value(fill)
            if value is None or value > _MASKED_VALUE:
                raise _Skip(f"masked_fill value {fill} is not -inf or a large negative constant"
                            + _unknown_fill(fill))
            if math.isfinite(value):
                cand.finite_fills.append(value)
            else:
                cand.inf_fill = True
            fills[len(steps)] = value
            steps.append(("keep", cond))
            cand.masks.keeps.append((cond, True))
            cand.masks.stages[cond] = _shape(scores)
            consumer, x = x, scores
            continue
        if _where_operands(x) is not None:
            # torch.where(cond, s, fill), or s.where(cond, fill): the same, self the kept value
            cond, a, b = _where_operands(x)
            ra, rb = _reaches_matmul(a), _reaches_matmul(b)
            if ra == rb:
                raise _Skip(f"cannot tell the scores from the fill value in '{x.name}'")
            scores, fill = (a, b) if ra else (b, a)
            cond = _unexpanded_mask(cand, cond, x, scores)
            value = _fill_value(fill)
            if value is None or value > _MASKED_VALUE:
                raise _Skip(f"torch.where fill {fill} is not -inf or a large negative constant"
                            + _unknown_fill(fill))
            if not _same_dims(_shape(x) or (), _shape(scores) or ()):
                raise _Skip(f"torch.where '{x.name}' broadcasts the scores {list(_shape(scores) or [])} to "
                            f"{list(_shape(x) or [])}")
            if math.isfinite(value):
                cand.finite_fills.append(value)
            else:
                cand.inf_fill = True
            fills[len(steps)] = value
            steps.append(("keep", cond))
            cand.masks.keeps.append((cond, not ra))
            cand.masks.stages[cond] = _shape(scores)
            consumer, x = x, scores
            continue
        clamp = _score_clamp(x)
        if clamp is not None:
            # max(s, finfo.min) is s for every finite s, gradient included (the tie at finfo.min is on a
            # masked key); only -inf (a -inf fill or mask, finfo.min plus a negative score overflowing)
            # becomes finfo.min: a masked value still, as the op takes every fill (a finite fill as -inf: the
            # rows with every key masked, reported below). max(s, -inf) is s.
            steps.append(("clamp", clamp[1]))
            consumer, x = x, clamp[0]
            continue
        if x.op == "call_function" and x.target in IN_PLACE_OPERATORS:
            raise _Skip(f"'{x.name}' updates the scores in place ({x.target.__name__}) on a view or a tensor "
                        "read elsewhere; only in-place updates of a freshly computed tensor are taken")
        raise _Skip(f"scores pass through '{x.name}' ({name or x.target}), which is not part of attention")
    if name == "baddbmm" and arg(x, 0, "input") is not None:
        # baddbmm's input is added inside q·kᵀ's own node: the innermost mask step. Scales outside scale
        # it too, (bias + q·kᵀ) / √d, which the op's mask would not be (checked below like any add).
        bias = arg(x, 0, "input")
        if x.kwargs.get("beta", 1) != 0 and not _is_zero_constant(bias):
            steps.append(("add", bias))
    # A multiplicative mask keeps the scores where b is 1 only as long as they are finite where b is 0 (-inf
    # * 0 is NaN: eager's row is NaN). A mask applied inside it that may leave -inf (a -inf fill, an additive
    # mask: -inf, or finfo.min plus a negative score) is left alone; a finite fill inside it is fine.
    for i in multiplied:
        for j in range(i + 1, len(steps)):
            kind = steps[j][0]
            if kind in ("add", "sub") or kind == "keep" and not math.isfinite(fills[j]):
                raise _Skip("a mask applied to the scores before the multiplicative mask (scores * b - c "
                            "* (1 - b)) may leave -inf scores where b is 0, which eager turns into NaN "
                            "(-inf * 0)")
    # A clamp at finfo.min makes the -inf of the masks inside it finfo.min: on a row with every key masked
    # eager gives the average of v, not NaN, as for a finite fill.
    clamps = [i for i, (kind, bound) in enumerate(steps) if kind == "clamp" and math.isfinite(bound)]
    if clamps:
        if any(kind in ("add", "sub", "keep") for kind, _ in steps[clamps[0] + 1:]):
            cand.finite_fills.append(steps[clamps[0]][1])
        cand.inf_fill = any(not math.isfinite(value) for i, value in fills.items() if i < clamps[0])
    # A symbolic or tensor factor after any mask (or a clamp at finfo.min) is left alone (sign unknown).
    seen_mask = False
    for kind, _ in reversed(steps):  # innermost first
        if kind in ("add", "sub", "keep", "clamp"):
            seen_mask = True
        elif kind in ("symbolic scale", "tensor scale") and seen_mask:
            raise _Skip(f"the scores are scaled by a {kind.split()[0]} factor (sign unknown) after masking")
    # A constant scale after a mask. A fill must still be a masked value once scaled: where(m, s, -1e4) * 1e-3
    # leaves -10, which softmax does not send to 0. An additive mask would be scaled too, (s + m) * c: taken
    # only when m is 0 or masked out (still so once scaled), where s * c + m is the same function: CodeGen's
    # `(w + causal_padding_mask) / scale_attn`. A real bias (Falcon's `(w + alibi) * inv_norm_factor`) is
    # left alone: s * c + m * c rounds differently.
    after = 1.0  # product of the constant scales outside the current step
    for i, (kind, obj) in enumerate(steps):  # outermost first
        if kind == "scale":
            after *= obj
        elif kind == "keep" and after != 1.0 and fills[i] * after > _MASKED_VALUE:
            raise _Skip(f"the fill value {fills[i]:.3g} is scaled by {after:.3g} afterwards, to "
                        f"{fills[i] * after:.3g}: not a masked-out value")
        elif kind == "clamp" and after != 1.0 and obj * after > _MASKED_VALUE:
            raise _Skip(f"the scores are clamped at {obj:.3g} and scaled by {after:.3g} afterwards, to "
                        f"{obj * after:.3g}: not a masked-out value")
        elif kind == "sub" and after != 1.0:
            raise _Skip("the scores are scaled after a mask was subtracted from them: the mask would be "
                        "scaled too")
        elif kind == "add" and after != 1.0 and not _zero_or_masked(obj, after):
            raise _Skip("the scores are scaled after an additive mask was added, and the mask is not one of "
                        "0 and masked-out values only")
    cand.uniform_masked_rows = _uniform_masked_rows(cand, steps, fills)
    return x


def _uniform_masked_rows(cand: _Candidate, steps, fills: dict) -> bool:
    """Whether eager's scores on a row with every key masked are all one value (steps: _scores_side's,
    outermost first), so that its softmax there is uniform and its output the mean of v.

    Each masked key holds the fill of the outermost keep step that masks it, and what comes after
    (constant scales, casts, per-row shifts) maps equal values to equal values. So: one finite fill value
    for every keep step, and every additive mask inside all of them (overwritten on the keys they mask),
    holding values far from overflow only (_holds_finite: a key that such a mask alone makes -inf is masked
    in the op, whose row then sees no key where eager's row averages the filled keys only). A mask added
    after a fill adds to it (two
    finfo.min overflow to -inf on some keys: eager averages over the others); a clamp makes the -inf fills
    inside it its bound: both left as they were (the op gives 0 there, reported)."""
    keeps = [i for i, (kind, _) in enumerate(steps) if kind == "keep"]
    if not keeps or cand.inf_fill or len(set(cand.finite_fills)) != 1 or len({fills[i] for i in keeps}) != 1:
        return False
    for i, (kind, obj) in enumerate(steps):
        if kind == "clamp":
            return False
        if kind in ("add", "sub") and (i < max(keeps) or not _holds_finite(obj)):
            return False
    return True


# factories of finite values: the position of their fill value, None for zeros / ones
_FINITE_FACTORIES = {"full": 1, "new_full": 2, "full_like": 1, "zeros": None, "ones": None,
                     "zeros_like": None, "ones_like": None, "new_zeros": None, "new_ones": None}


def _holds_finite(node, depth: int = 12) -> bool:
    """Whether a mask holds finite values only, at most half its dtype's range: constants of that size, a
    factory filled with one, torch.where or masked_fill (in place too) of such values, seen through views
    and casts to a dtype of no smaller range. flash-attn's key padding bias is ``torch.full(.., -10000.0)
    .masked_fill_(keep, 0.0)``. The margin: the kernels scale the mask by log2(e), which makes a finfo.min
    -inf, a key masked in the op that eager does not fill."""
    if is_number(node):
        return abs(float(node)) <= torch.finfo(torch.float32).max / 2
    if not isinstance(node, Node) or depth == 0:
        return False
    meta = tensor_meta(node)
    if meta is None or not meta.dtype.is_floating_point:
        return False

    def fits(value) -> bool:
        return is_number(value) and abs(float(value)) <= torch.finfo(meta.dtype).max / 2

    name = op_name(node)
    if node.op == "call_function" and node.target is operator.getitem:
        name = "getitem"
    for writer in in_place_writers(node):
        # a write of a finite constant (masked_fill_, fill_) keeps it finite; any other write is unknown
        if not (op_name(writer) in ("masked_fill_", "fill_") and fits(writer.args[-1])):
            return False
    if name in _FINITE_FACTORIES:
        position = _FINITE_FACTORIES[name]
        return position is None or fits(arg(node, position, "fill_value"))
    if _where_operands(node) is not None:
        return all(fits(a) or isinstance(a, Node) and _dtype(a) == meta.dtype and _holds_finite(a, depth - 1)
                   for a in _where_operands(node)[1:])
    if name in ("masked_fill", "masked_fill_") and len(node.args) == 3 and not node.kwargs:
        return _holds_finite(node.args[0], depth - 1) and fits(node.args[2])
    if name in _MASK_PASSTHROUGH and isinstance(node.args[0], Node) and tensor_meta(node.args[0]) is not None:
        source = tensor_meta(node.args[0]).dtype
        return (source.is_floating_point and torch.finfo(source).max <= torch.finfo(meta.dtype).max
                and (name != "view" or source == meta.dtype) and _holds_finite(node.args[0], depth - 1))
    if meta.numel() <= _CONST_EVAL_MAX_NUMEL:
        try:
            values = torch.as_tensor(_const_eval(node), dtype=torch.float64)
            return bool((values.abs() <= torch.finfo(meta.dtype).max / 2).all())
        except Exception:  # noqa: BLE001 - not a compile-time constant
            return False
    return False


def _einsum_operands(node: Node) -> tuple[object, list]:
    """(equation, operands) of einsum(eq, a, b) or einsum(eq, [a, b])."""
    args = node.args
    if len(args) == 2 and isinstance(args[1], (list, tuple)):
        return args[0], list(args[1])
    return args[0], list(args[1:])


def _baddbmm_operands(cand: _Candidate, mm: Node):
    """beta·input + alpha·(q @ kᵀ): alpha is a scale on the product, input (beta 1) an additive mask."""
    bias, q, kt = (arg(mm, i, n) for i, n in ((0, "input"), (1, "batch1"), (2, "batch2")))
    alpha, beta = mm.kwargs.get("alpha", 1), mm.kwargs.get("beta", 1)
    # alpha = 1/sqrt(D) is a SymFloat under dynamic=True; it scales the product only (never the input),
    # so it folds into the op's scale like any symbolic factor on the scores.
    factor = _scalar_factor(alpha)
    if factor is None or not is_number(beta):
        raise _Skip("baddbmm alpha or beta is not a number")
    if is_number(factor) and not math.isfinite(factor):
        # alpha=nan / inf makes every score NaN or infinite: eager's function, not a scale the op takes
        raise _Skip(f"baddbmm alpha={factor} is not a finite number")
    cand.fold(("mul", factor) if isinstance(factor, Node) else factor)
    if beta not in (0, 1):
        raise _Skip(f"baddbmm beta={beta}: the input would be scaled, not an additive mask")
    if beta == 1 and not _is_zero_constant(bias):
        cand.masks.additive.append(bias)
    return q, kt


def _is_zero_constant(node) -> bool:
    if is_number(node):
        return node == 0
    # By construction, whatever its (possibly symbolic) size: GPT-NeoX's baddbmm(torch.zeros(B·H, S, S), ..)
    name = op_name(node) if isinstance(node, Node) else None
    if name in ("zeros", "zeros_like", "new_zeros") and not in_place_writers(node):
        return True  # and nothing writes into it in place
    try:
        value = _const_eval(node)
    except Exception:  # noqa: BLE001 - a runtime tensor
        return False
    return isinstance(value, torch.Tensor) and not bool(value.any())


def _qk(cand: _Candidate, mm: Node):
    """Split q·kᵀ into q and k in (batch..., S, D) layout, folding scales on either."""
    cand.chain.append(mm)
    name = op_name(mm)
    if name == "einsum":
        eq, operands = _einsum_operands(mm)
        if not isinstance(eq, str) or len(operands) != 2:
            raise _Skip("einsum is not a two-operand contraction")
        (a_l, b_l), out = _parse_einsum(eq, 2, [len(_shape(o) or ()) or None for o in operands])
        q, k = operands
        if len(out) >= 2 and out[-2] in b_l and out[-2] not in a_l:
            # k listed first, einsum("bhkd,bhqd->bhqk", k, q): the same product. Whichever operand owns the
            # scores' second-to-last dim is q (the rows the softmax normalises), the other k.
            (a_l, b_l), (q, k) = (b_l, a_l), (k, q)
        d = [c for c in a_l if c in b_l and c not in out]
        batch = list(out[:-2])
        # k may lack batch subscripts of q and the scores: einsum broadcasts k over them (multi-query,
        # "bhid,bjd->bhij"), as matmul does over a size-1 dim. Every other letter is in both or summed.
        if (
            len(d) != 1
            or len(out) < 3
            or out[-2] not in a_l
            or out[-2] in b_l
            or out[-1] not in b_l
            or out[-1] in a_l
            or sorted(a_l) != sorted(batch + [out[-2]] + d)
            or any(c not in batch + [out[-1]] + d for c in b_l)
            or len(b_l) < 3
        ):
            raise _Skip(f"einsum '{eq}' is not q·kᵀ with the scores' key dim last")
        cand.variant = "einsum"
        cand.q_perm = [a_l.index(c) for c in batch + [out[-2]] + d]
        cand.k_perm = [b_l.index(c) for c in batch + [out[-1]] + d if c in b_l]
        cand.k_unsqueeze = [n for n, c in enumerate(batch) if c not in b_l]
        cand.batch_dims = len(batch)
        cand.q, cand.k = _strip_scales(cand, q, mm), _strip_scales(cand, k, mm)
        return
    cand.variant = name
    if name == "baddbmm":
        q, kt = _baddbmm_operands(cand, mm)  # Bloom: alibi.baddbmm(batch1=q, batch2=kᵀ, ...)
    else:
        # by position or keyword (torch.matmul(input=q, other=kt), torch.bmm(q, mat2=kt)), nothing else
        names = ("input", "mat2" if name == "bmm" else "other")
        q, kt = arg(mm, 0, names[0]), arg(mm, 1, names[1])
        if len(mm.args) > 2 or set(mm.kwargs) - set(names[len(mm.args):]):
            raise _Skip(f"'{mm.name}' does not take q and kᵀ as its two operands")
    if not (isinstance(q, Node) and isinstance(kt, Node)):
        raise _Skip("q·kᵀ operands are not tensors")
    ndim = len(_shape(q) or ())
    if ndim < 3 or len(_shape(kt) or ()) != ndim:
        raise _Skip(f"q·kᵀ operands are {ndim}-d; the flash op takes (B, H, S, D) or (BH, S, D)")
    cand.batch_dims = ndim - 2
    kt = _strip_scales(cand, kt, mm)
    while op_name(kt) in _IDENTITY and isinstance(kt.args[0], Node):  # kᵀ.contiguous(): the same values
        cand.chain.append(kt)
        kt = kt.args[0]
    try:
        k, cand.k_perm = _untranspose(kt, ndim)
    except _Skip as skip:
        if ndim > 4:  # (q·kᵀ over more than two batch dims is taken as _Layout._merge says)
            raise _Skip(f"q·kᵀ operands are {ndim}-d: {skip}") from None
        raise
    cand.chain.append(kt)  # erased only if the rewrite leaves it without users
    cand.k = _strip_scales(cand, k, kt)
    cand.q = _strip_scales(cand, q, mm)


# --------------------------------------------------------------------------------------------------------
# The probabilities side: softmax -> casts / dropout -> ·v
# --------------------------------------------------------------------------------------------------------


# Elementwise ops on the probabilities (transformers' ``probs * head_mask``, padded queries zeroed after the
# softmax, a renormalisation): never part of the pattern, but a softmax of q·kᵀ that reaches ·v through one
# is a candidate the walk reports with its reason rather than one that is silently not seen.
_PROBS_ELEMENTWISE = ("mul", "div", "add", "sub", "masked_fill", "masked_fill_", "where")


def _swaps_last_two(node: Node, of: Node) -> bool:
    """Whether node is ``of`` with its last two dims swapped and nothing else: transpose / swapaxes / swapdims
    of the last two, a permute keeping the others in order, ``.mT``."""
    ndim = len(_shape(of) or ())
    if ndim < 2 or not isinstance(node, Node) or not node.args or node.args[0] is not of:
        return False
    name = op_name(node)
    if name in ("transpose", "swapaxes", "swapdims"):
        keys = ("axis0", "axis1") if name == "swapaxes" else ("dim0", "dim1")
        dims = [arg(node, i + 1, key) for i, key in enumerate(keys)]
        return all(isinstance(d, int) for d in dims) and sorted(norm_dim(d, ndim) for d in dims) == [
            ndim - 2, ndim - 1]
    if name == "permute":
        perm = node.args[1:] if len(node.args) > 1 else node.kwargs.get("dims", ())
        if len(perm) == 1 and isinstance(perm[0], (list, tuple)):
            perm = perm[0]
        return all(isinstance(d, int) for d in perm) and [norm_dim(d, ndim) for d in perm] == list(
            range(ndim - 2)) + [ndim - 1, ndim - 2]
    return node.op == "call_function" and node.target is getattr and node.args[1] == "mT"


def _swapped_into_pv(node: Node) -> Node | None:
    """The matmul / bmm that reads node (the probabilities) with its last two dims swapped as its right
    operand, ``v' @ pᵀ`` (the swap its only user, the matmul the swap's), else None."""
    users = list(node.users)
    if len(users) != 1 or not _swaps_last_two(users[0], node) or len(users[0].users) != 1:
        return None
    swap = users[0]
    mm = next(iter(swap.users))
    name = op_name(mm)
    if name not in ("matmul", "bmm") or mm.kwargs:
        return None
    if len(mm.args) != 2 or mm.args[1] is not swap or mm.args[0] is swap:
        return None
    return mm


def _feeds_matmul(node: Node, depth: int = 8, also: tuple = ()) -> bool:
    """Whether node reaches a matmul through the probabilities' elementwise ops (and the ops in also)."""
    if _swapped_into_pv(node) is not None:
        return True
    for user in node.users:
        name = op_name(user)
        if name in _MATMULS:
            return True
        if depth and (
            name in _CASTS + _IDENTITY + _RESHAPES + _PROBS_ELEMENTWISE + ("dropout", "dropout_") + also
            or user.target is torch.nn.functional.dropout
        ):
            if _feeds_matmul(user, depth - 1, also):
                return True
    return False


_CATS = ("cat", "concat", "concatenate")


def _concatenated_scores(node, depth: int = 16, seen: set | None = None) -> Node | None:
    """The torch.cat along the last (key) dim, reached from a softmax input through the scores' elementwise
    ops, that joins q·kᵀ's scores with other columns (GPT-OSS's attention sinks: ``cat([s, sinks], -1)``),
    else None. Such a softmax is no attention the op computes: its probabilities over the keys sum to less
    than 1 (the other columns take the rest), and the op's softmax runs over the keys alone."""
    seen = set() if seen is None else seen
    if not isinstance(node, Node) or depth == 0 or node in seen:
        return None
    seen.add(node)
    name = op_name(node)
    if name in _CATS:
        tensors, ndim = arg(node, 0, "tensors"), len(_shape(node) or ())
        if (isinstance(tensors, (list, tuple)) and len(tensors) > 1 and ndim
                and norm_dim(arg(node, 1, "dim", 0), ndim) == ndim - 1
                and any(map(_reaches_matmul, tensors))):
            return node
        return None
    if name in _RESHAPES + _CASTS + _IDENTITY + _SCORE_ELEMENTWISE or _bound_parts(node) is not None:
        for a in _value_inputs(node):
            found = _concatenated_scores(a, depth - 1, seen)
            if found is not None:
                return found
    return None


def _dropout_p(node: Node):
    """The dropout probability in effect: 0 outside training, else p (a number, or a SymFloat node)."""
    # torch.dropout and its in-place torch.dropout_ name the flag `train`; F.dropout names it `training`
    train_kw = "train" if node.op == "call_function" and node.target in (torch.dropout, torch.dropout_) \
        else "training"
    p, training = arg(node, 1, "p", 0.5), arg(node, 2, train_kw, True)
    if training is False:
        return 0.0
    if training is not True:
        raise _Skip(f"dropout '{node.name}' has a non-constant training flag")
    if is_number(p):
        return float(p)
    if isinstance(p, Node) and isinstance(val(p), (float, torch.SymFloat)):
        return p  # dynamic=True turns module floats into graph inputs; the op specialises on them
    raise _Skip(f"dropout '{node.name}' has a p that is neither a number nor a scalar")


def _zeroed_at_mask(cand: _Candidate, node: Node, probs: Node) -> bool:
    """Whether node is ``probs.masked_fill(m, 0)`` with m (the same node) a condition the scores were
    masked_fill'ed with before the softmax, in the same shape: ESPnet's and wenet's
    ``torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)`` (every Conformer / Transformer of both, FunASR).

    The identity where the row keeps a key: there the masked keys' probabilities are exp(-inf) = 0 already
    (or exp(fill - max) for a finite fill at or below -1e4, which the op takes as -inf: 0 as the fill's
    policy says). On a row with every key masked by m eager's NaN (-inf fill) or uniform row (finite fill)
    becomes 0, which is what the op returns there; its gradient is 0 in both (masked_fill passes none to
    the masked entries). So the zeroing is the op's own, and is dropped."""
    if op_name(node) != "masked_fill" or arg(node, 0, "input") is not probs or len(node.args) + len(
            node.kwargs) != 3:
        return False
    cond, fill = arg(node, 1, "mask"), arg(node, 2, "value")
    if not isinstance(cond, Node) or not is_number(fill) or isinstance(fill, bool) or fill != 0:
        return False
    if not any(c is cond and negate for c, negate in cand.masks.keeps):
        return False
    stage = cand.masks.stages.get(cond)
    return stage is not None and _same_dims(_shape(probs) or (), stage) and _same_dims(
        _shape(node) or (), _shape(probs) or ())


def _zeroed_rows(node: Node, probs: Node) -> Node | None:
    """m when node is ``probs.masked_fill(m, 0)`` with m a bool tensor constant along the key dim (last dim
    1) that fits the probabilities: whole query rows zeroed (Flamingo / OpenFlamingo's text before any
    image, ``attn.masked_fill(text_time == 0 [b 1 i 1], 0.)``); else None.

    A zero row of the probabilities is a zero row of probabilities·v, exactly, whatever v holds, and neither
    passes a gradient (masked_fill passes none to the filled entries): the same function as the op's output
    with those rows zeroed, which is what the rewrite computes (the fill moved after the op). Casts and
    dropout between the zeroing and ·v keep zeros zero; a view of the probabilities after it, or an output
    laid out otherwise than the probabilities, is refused where the op is emitted (_check_zeroed_rows)."""
    if op_name(node) != "masked_fill" or arg(node, 0, "input") is not probs or len(node.args) + len(
            node.kwargs) != 3:
        return None
    cond, fill = arg(node, 1, "mask"), arg(node, 2, "value")
    if not isinstance(cond, Node) or not is_number(fill) or isinstance(fill, bool) or fill != 0:
        return None
    shape, probs_shape = _shape(cond), _shape(probs)
    if (
        not shape
        or probs_shape is None
        or _dtype(cond) != torch.bool
        or shape[-1] != 1
        or not _fits(shape, probs_shape)
        or not _same_dims(_shape(node) or (), probs_shape)
    ):
        return None
    return cond


def _check_zeroed_rows(cand: _Candidate):
    """The rows zeroed after the softmax (_zeroed_rows) are rows of the op's output in the layout ·v gives:
    no view of the probabilities after the zeroing, ·v not reading them transposed, no output permute."""
    for cond, views in cand.zeroed_rows:
        if (
            views != len(cand.prob_views)
            or cand.probs_swap is not None
            or (cand.out_perm is not None and cand.out_perm != sorted(cand.out_perm))
        ):
            raise _Skip(f"the rows zeroed by '{cond.name}' after the softmax are not rows of the output as "
                        "·v lays it out")


def _probs_side(cand: _Candidate, softmax: Node) -> tuple[Node, Node]:
    """Walk from softmax up to the ·v matmul; returns it and the probabilities it reads (which operand
    they are is _pv's to check: vᵀ @ p contracts over the queries)."""
    x = softmax
    cand.dropout_p = 0.0
    while True:
        swapped = _swapped_into_pv(x)
        if swapped is not None:
            cand.probs_swap = next(iter(x.users))
            cand.chain.append(cand.probs_swap)
            return swapped, x
        users = list(x.users)
        if len(users) != 1:
            what = "are also returned or reused" if users else "are unused"
            raise _Skip(f"attention probabilities '{x.name}' {what} ({len(users)} users)")
        user = users[0]
        name = op_name(user)
        if name in _MATMULS:
            return user, x
        if name in _CASTS or name in _IDENTITY:
            if user.args[0] is not x:
                raise _Skip(f"'{user.name}' uses the probabilities as a dtype template")
            cand.chain.append(user)
            x = user
            continue
        if name in _RESHAPES and user.args[0] is x:
            _check_leading_reshape(user, "probabilities")
            cand.prob_views.append(user)
            cand.chain.append(user)
            x = user
            continue
        if _zeroed_at_mask(cand, user, x):
            cand.zeroed.append(user)
            cand.chain.append(user)
            x = user
            continue
        rows = _zeroed_rows(user, x)
        if rows is not None:
            cand.zeroed_rows.append((rows, len(cand.prob_views)))
            cand.chain.append(user)
            x = user
            continue
        if name in ("dropout", "dropout_") or (
            user.op == "call_function" and user.target in (torch.nn.functional.dropout, torch.dropout)
        ):
            if cand.dropout_p:
                raise _Skip("more than one dropout on the probabilities")
            cand.dropout_p = _dropout_p(user)
            if is_number(cand.dropout_p) and not 0.0 <= cand.dropout_p < 1.0:
                raise _Skip(f"dropout p={cand.dropout_p} outside [0, 1)")
            cand.chain.append(user)
            x = user
            continue
        raise _Skip(f"the probabilities go to '{user.name}' ({name or user.target}), not to a matmul with v")


def _pv(cand: _Candidate, pv: Node, probs: Node):
    cand.chain.append(pv)
    name = op_name(pv)
    if name == "einsum":
        eq, operands = _einsum_operands(pv)
        if not isinstance(eq, str) or len(operands) != 2 or not any(o is probs for o in operands):
            raise _Skip("the probabilities are not an operand of the ·v einsum")
        (p_l, v_l), out = _parse_einsum(eq, 2, [len(_shape(o) or ()) or None for o in operands])
        v = operands[1]
        if operands[0] is not probs:
            # einsum("bhjd,bhij->bhid", v, p): the same contraction with the operands listed the other way
            (p_l, v_l), v = (v_l, p_l), operands[0]
        if len(p_l) != len(_shape(probs) or ()):
            raise _Skip(f"einsum '{eq}' does not take the scores' layout")
        batch, i, j = list(p_l[:-2]), p_l[-2], p_l[-1]
        e = [c for c in v_l if c not in p_l]
        # v may lack batch subscripts of the probabilities (multi-query "bhij,bjd->bhid"): broadcast over
        if (
            len(e) != 1
            or j not in v_l
            or i in v_l
            or any(c not in batch + [j] + e for c in v_l)
            or sorted(out) != sorted(batch + [i] + e)
        ):
            raise _Skip(f"einsum '{eq}' is not probabilities·v")
        cand.v = v
        cand.v_perm = [v_l.index(c) for c in batch + [j] + e if c in v_l]
        cand.v_unsqueeze = [n for n, c in enumerate(batch) if c not in v_l]
        produced = batch + [i] + e
        cand.out_perm = [produced.index(c) for c in out]
        cand.variant += "+einsum"
        return
    if cand.probs_swap is not None:
        # v' @ pᵀ (v' = vᵀ, (batch..., Dv, Sk)) = (p @ v'ᵀ)ᵀ: the op takes v = v' with its last two dims
        # swapped, and its output (batch..., Sq, Dv) is swapped back into v' @ pᵀ's (batch..., Dv, Sq)
        ndim = len(_shape(probs) or ())
        v = pv.args[0]
        if not isinstance(v, Node) or len(_shape(v) or ()) != ndim:
            raise _Skip("v does not have the probabilities' batch dims")
        cand.v = v
        cand.v_perm = cand.out_perm = list(range(ndim - 2)) + [ndim - 1, ndim - 2]
        return
    # by position or keyword: torch.matmul(p, other=v), torch.bmm(input=p, mat2=v) (an IndexError before;
    # review s27, forms)
    left, right = arg(pv, 0, "input"), arg(pv, 1, "mat2" if name == "bmm" else "other")
    if left is not probs or not isinstance(right, Node):
        raise _Skip("the probabilities are not the left operand of the ·v matmul")
    cand.v = right
    if len(_shape(cand.v) or ()) != len(_shape(probs) or ()):
        raise _Skip("v does not have the probabilities' batch dims")


# --------------------------------------------------------------------------------------------------------
# GQA: k/v repeated to q's heads (repeat_kv's expand + reshape, or repeat_interleave) are passed un-repeated
# --------------------------------------------------------------------------------------------------------


def _unrepeated(node: Node, end: Node, head_dim: int = 1) -> tuple[Node, int]:
    """_unrepeat's answer, or (node, 1) when k's memory (k before the repeat, or the repeated copy) is
    written in place between the repeat and end, the attention's last node: the repeat copies k where it
    runs, and the op, reading k un-repeated at end, would see the write that the copy does not (or miss one
    into the copy). Then k is passed repeated, which is what eager reads."""
    base, n = _unrepeat(node, head_dim)
    if n > 1:
        order = {x: i for i, x in enumerate(node.graph.nodes)}
        if any(order[node] < order[w] < order[end] for w in in_place_writers(base)):
            return node, 1
    return base, n


def _unrepeat(node: Node, head_dim: int = 1) -> tuple[Node, int]:
    """(k before its heads were repeated, the repeat count) for a 4-d k whose heads are dim head_dim
    (1 in (B, H, S, D); 2 in transformers' (B, S, H, D), permuted for the op): ``repeat_interleave`` over
    the heads, Llama's ``repeat_kv`` and litgpt's GQA (a size-1 dim inserted after the heads by unsqueeze(2)
    or ``k[:, :, None]``, expanded, and merged into the heads by reshape, view or flatten(1, 2); (B, H, S, D)
    only), or one head expanded to all (multi-query); else (node, 1).

    The op pairs q head h with k head h // n (n = the repeat count). (B, G, 1, S, D) expanded to
    (B, G, n, S, D) holds k[:, g] at [:, g, r], and the row-major merge of (G, n) puts it at head g·n + r: k
    head h // n, what repeat_interleave(n, dim=1) gives. Only an expand of a size-1 dim is a pure repeat;
    the size-1 dim inserted before the heads instead (``k[:, None].expand(B, n, G, ..)``) tiles them, head
    r·G + g: k head h % G, another pairing, passed repeated."""
    name = op_name(node)
    if name == "repeat_interleave":
        repeats, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
        shape = _shape(node)
        if isinstance(repeats, int) and shape is not None and len(shape) == 4 and isinstance(dim, int) \
                and norm_dim(dim, 4) == head_dim and len(node.kwargs.keys() - {"repeats", "dim"}) == 0:
            return node.args[0], repeats
        return node, 1
    if head_dim != 1:
        return node, 1
    if name in ("expand", "expand_as") and isinstance(node.args[0], Node):
        # one k / v head expanded to q's (multi-query): (B, 1, S, D) -> (B, H, S, D), each head that one
        bs, es = _shape(node.args[0]), _shape(node)
        if bs is not None and es is not None and len(bs) == len(es) == 4 and bs[1] == 1 \
                and _same_dims((bs[0], *bs[2:]), (es[0], *es[2:])) and isinstance(es[1], int) and es[1] > 1:
            return node.args[0], es[1]
        return node, 1
    # (flatten(1, 2) merges the same dims row-major as the reshape: the shapes below prove which; a row-major
    # reshape's result is fixed by its target shape alone)
    if name in ("reshape", "view", "flatten") and isinstance(node.args[0], Node):
        expanded = node.args[0]
        if op_name(expanded) not in ("expand", "expand_as") or not isinstance(expanded.args[0], Node):
            return node, 1
        unsq = expanded.args[0]
        un = op_name(unsq)
        if un == "unsqueeze" and norm_dim(arg(unsq, 1, "dim"), 5) == 2:
            base = unsq.args[0]
        elif (
            un == "getitem"
            and isinstance(unsq.args[1], tuple)
            and len(unsq.args[1]) >= 3
            and unsq.args[1][2] is None
            and all(s == slice(None) for s in unsq.args[1][:2])
            # k[:, :, None, :, :], k[:, :, None], k[:, :, None, ...]
            and all(s == slice(None) or s is Ellipsis for s in unsq.args[1][3:])
        ):
            base = unsq.args[0]
        else:
            return node, 1
        bs, us, es, rs = _shape(base), _shape(unsq), _shape(expanded), _shape(node)
        if bs is None or us is None or es is None or rs is None or len(bs) != 4 or len(es) != 5:
            return node, 1
        b, h, s, d = bs
        n = es[2]
        if us == (b, h, 1, s, d) and es == (b, h, n, s, d) and rs == (b, h * n, s, d):
            return base, n
    return node, 1


# --------------------------------------------------------------------------------------------------------
# Rewrites
# --------------------------------------------------------------------------------------------------------


def _permuted(graph, node, perm, like):
    if perm is None or perm == sorted(perm):
        return node
    return insert_call(graph, torch.permute, (node, tuple(perm)), like=like)


def _mask_kwargs(mask, causal) -> dict:
    """A causal band next to a mask is the (-1, 0) window (top-left, as is_causal): flash_attention, like
    SDPA, refuses is_causal together with attn_mask. causal=BOTTOM_RIGHT (_Masks.build) is the same band
    aligned to the bottom-right corner: causal_alignment="bottom_right", which anchors the window too."""
    align = {"causal_alignment": BOTTOM_RIGHT} if causal == BOTTOM_RIGHT else {}
    if causal and mask is not None:
        return {"attn_mask": mask, "is_causal": False, "window_size": (-1, 0), **align}
    return {"attn_mask": mask, "is_causal": bool(causal), **align}


def _causal_detail(causal) -> str:
    return "causal bottom-right (Sk - Sq keys ahead)" if causal == BOTTOM_RIGHT else "causal"


def _merge_batch_dims(graph: Graph, q: Node, tensors, lead, like: Node) -> tuple[list[Node], tuple]:
    """tensors (q, k, v) of batch dims lead (more than two: Hiera's mask units, Twins' windows) flattened
    over the dims after the first, for the op's (B, H); and the sizes to unflatten its output with (dim 1),
    q's own: symbolic ones read from q. Shared by the manual path (_Layout._merge) and SDPA's
    (_rewrite_sdpa)."""
    sizes = tuple(d if isinstance(d, int) else insert_call(graph, torch.ops.aten.sym_size.int, (q, i),
                                                           like=like)
                  for i, d in enumerate(lead) if i)
    last = len(lead) - 1
    return [insert_call(graph, torch.flatten, (t, 1, last), like=like) for t in tensors], sizes


class _Layout:
    """One (batch, head) layout for the op when the scores were reshaped between q·kᵀ and ·v.

    q·kᵀ may be (B·H, Sq, Sk) from bmm and viewed to (B, H, Sq, Sk) for the mask, or the other way
    round; the probabilities may be viewed again before ·v. Every such view was checked to split or merge
    the leading dims only, so all of them index the same (batch·head) rows in row-major order. The op
    runs in the first 4-d layout seen (q·kᵀ's own, else the first 4-d view: (B, H) is what the kernel's
    row masks and GQA expect), q, k, v and the masks are reshaped into it, and the output back.
    All checks happen here, at construction; the graph is edited only by inputs() and output().
    """

    def __init__(self, cand: _Candidate, scores_shape, probs_shape, k_shape, v_shape):
        self.cand = cand
        self.qk_lead, self.pv_lead = tuple(scores_shape[:-2]), tuple(probs_shape[:-2])
        self.canon, self.canon_view = self.qk_lead, None
        self.merged = len(self.qk_lead) > 2
        if self.merged:
            self._merge(scores_shape, k_shape, v_shape)
            return
        if len(self.canon) == 1:
            for view in cand.score_views + cand.prob_views:
                if len(_shape(view)) == 4:
                    self.canon, self.canon_view = tuple(_shape(view)[:2]), view
                    break
        if len(self.pv_lead) not in (1, 2):
            raise _Skip(f"the probabilities reach ·v as {list(probs_shape)}: {len(self.pv_lead)} batch dims")
        # q·kᵀ's own layout keeps whatever broadcasting matmul did (GQA's un-repeated k is checked later);
        # a tensor that is reshaped must hold every (batch·head) row itself.
        self.convert_qk = not _same_dims(self.qk_lead, self.canon)
        self.convert_pv = not _same_dims(self.pv_lead, self.canon)
        if self.convert_qk and not _same_dims(k_shape[:-2], self.qk_lead):
            raise _Skip(f"k {list(k_shape)} broadcasts over the scores' batch dims {list(self.qk_lead)}")
        if self.convert_pv and not _same_dims(v_shape[:-2], self.pv_lead):
            raise _Skip(
                f"v {list(v_shape)} broadcasts over the probabilities' batch dims {list(self.pv_lead)}"
            )
        self.mask_plans = {node: self._mask_plan(node, scores_shape) for node in cand.masks.nodes()}
        splits = self.convert_qk or self.convert_pv or any(
            isinstance(p, tuple) and p[0] == "rows" for p in self.mask_plans.values()
        )
        self.lead_args = None  # how to split into the canonical (B, H): ints, a view's size args, or q's
        if len(self.canon) == 2 and splits:
            if all(isinstance(d, int) for d in self.canon):
                self.lead_args = list(self.canon)
            elif self.canon_view is not None:
                self.lead_args = _view_lead_args(self.canon_view, 2)
            else:
                self.lead_args = "q"  # q·kᵀ is 4-d: q carries the layout's sizes
            if self.lead_args is None:
                raise _Skip(
                    f"cannot tell the (batch, heads) sizes of '{self.canon_view.name}' under dynamic shapes"
                )
        if self.convert_pv and len(self.pv_lead) == 2 and not all(isinstance(d, int) for d in self.pv_lead):
            raise _Skip(
                f"the output's (batch, heads) layout {list(self.pv_lead)} is symbolic and not the op's"
            )

    def _merge(self, scores_shape, k_shape, v_shape):
        """More than two batch dims (Hiera's (B, heads, windows, tokens, head_dim) mask units): the op runs
        on (B, heads·windows, ...), q, k, v flattened over the dims after the first and the output
        unflattened back. The same function: each (batch..., query) row attends to the keys of the same
        batch index, in any row-major numbering of those. Only where q, k, v and the probabilities all
        hold every batch index themselves (no broadcast k / v, no view of the scores), and each mask
        either holds the merged dims or broadcasts over all of them (then over every merged index)."""
        lead = self.qk_lead
        refused = (f"q·kᵀ operands are {len(scores_shape)}-d (scores {list(scores_shape)}), merged into the "
                   "op's (B, H)")
        if (self.cand.score_views or self.cand.prob_views or not _same_dims(self.pv_lead, lead)
                or not _same_dims(k_shape[:-2], lead) or not _same_dims(v_shape[:-2], lead)):
            raise _Skip(f"{refused} only where q, k, v and the probabilities hold every batch index, "
                        f"unviewed (k {list(k_shape)}, v {list(v_shape)})")
        self.canon = (lead[0], _prod(lead[1:]))
        self.convert_qk = self.convert_pv = False
        self.lead_args = None
        self.mask_plans = {}
        for node in self.cand.masks.nodes():
            shape = _shape(node)
            if len(shape) == len(scores_shape) and (all(_holds(d == 1) for d in shape[1:-2])
                                                    or _same_dims(shape[1:-2], lead[1:])):
                # (B or 1, heads, windows, ..) or (B or 1, 1, 1, ..): merged as q, k, v are
                self.mask_plans[node] = "merge"
                continue
            try:
                plan = self._mask_plan(node, scores_shape)
            except _Skip:
                plan = "refused"
            if plan not in (None, "flatten"):
                raise _Skip(f"{refused} only with masks that hold all the batch dims after the first or "
                            f"none: mask {list(shape)}")
            self.mask_plans[node] = plan

    def _mask_plan(self, node: Node, scores_shape):
        """How a mask reaches the op's layout: None (it broadcasts as it is), "flatten" (a >4-d mask
        with no batch or head extent), ("rows", lead) (one row per (batch·head): reshaped like q and k,
        Bloom's (B·H, 1, Sk) alibi), or ("expand", stage lead, last two) (broadcast over some leading dims
        of a reshaped stage: expanded first, static shapes only)."""
        stage = self.cand.masks.stages.get(node, scores_shape)
        shape = _shape(node)
        padded = (1,) * (len(stage) - len(shape)) + tuple(shape)
        if all(_holds(d == 1) for d in padded[:-2]):
            return "flatten" if len(shape) > 4 else None  # independent of batch and head
        if _same_dims(stage[:-2], self.canon):
            return None
        if len(shape) == len(stage) and _same_dims(shape[:-2], stage[:-2]):
            return "rows", tuple(stage[:-2])
        if not all(isinstance(d, int) for d in tuple(stage) + tuple(shape) + self.canon):
            raise _Skip(
                f"mask {list(shape)} applies to the scores viewed as {list(stage)}; bringing it to the "
                f"{list(self.canon)} (batch, head) layout needs static shapes"
            )
        return "expand", tuple(stage[:-2]), tuple(padded[-2:])

    def op_shapes(self, q_shape, k_shape, v_shape):
        """q, k, v shapes as the op sees them: (B, H, S, D)."""
        canon4 = self.canon if len(self.canon) == 2 else (1,) + self.canon
        q_shape, k_shape, v_shape = (tuple(s) for s in (q_shape, k_shape, v_shape))
        if self.merged:
            return tuple(canon4 + s[-2:] for s in (q_shape, k_shape, v_shape))
        if self.convert_qk or len(self.canon) == 1:
            q_shape, k_shape = canon4 + q_shape[-2:], canon4 + k_shape[-2:]
        if self.convert_pv or len(self.canon) == 1:
            v_shape = canon4 + v_shape[-2:]
        return q_shape, k_shape, v_shape

    def _to_canon(self, graph, node, lead, q_in, like):
        if len(lead) > 1:
            node = insert_call(graph, torch.flatten, (node, 0, len(lead) - 1), like=like)
        if len(self.canon) > 1:
            if self.lead_args == "q":
                self.lead_args = [insert_call(graph, torch.ops.aten.sym_size.int, (q_in, d), like=like)
                                  for d in (0, 1)]
            node = insert_call(graph, torch.unflatten, (node, 0, tuple(self.lead_args)), like=like)
        return node

    def inputs(self, graph, q_in, k_in, v_in, like):
        """q, k, v (and the masks, in place) in the op's layout."""
        if self.merged:
            (q_in, k_in, v_in), self.merged_sizes = _merge_batch_dims(graph, q_in, (q_in, k_in, v_in),
                                                                      self.qk_lead, like)
        if self.convert_qk:
            q_in, k_in = (self._to_canon(graph, t, self.qk_lead, None, like) for t in (q_in, k_in))
        if self.convert_pv:
            v_in = self._to_canon(graph, v_in, self.pv_lead, q_in, like)
        if len(self.canon) == 1:
            q_in, k_in, v_in = (
                insert_call(graph, torch.unsqueeze, (t, 0), like=like) for t in (q_in, k_in, v_in)
            )
        masks = self.cand.masks
        remapped = {}
        for node, plan in self.mask_plans.items():
            if plan == "merge":
                last = len(self.qk_lead) - 1
                remapped[node] = insert_call(graph, torch.flatten, (node, 1, last), like=like)
            elif plan == "flatten":
                end_dim = len(_shape(node)) - 3
                remapped[node] = insert_call(graph, torch.flatten, (node, 0, end_dim), like=like)
            elif plan is not None and plan[0] == "rows":
                remapped[node] = self._to_canon(graph, node, plan[1], q_in, like)
            elif plan is not None:
                _, stage_lead, last2 = plan
                full = insert_call(graph, torch.Tensor.expand, (node, stage_lead + last2), like=like)
                remapped[node] = insert_call(graph, torch.reshape, (full, self.canon + last2), like=like)
        masks.keeps = [(remapped.get(n, n), negate) for n, negate in masks.keeps]
        masks.additive = [remapped.get(n, n) for n in masks.additive]
        masks.negated = {remapped.get(n, n) for n in masks.negated}
        masks.casts = {remapped.get(n, n): dtype for n, dtype in masks.casts.items()}
        self.cand.chain.extend(remapped.values())  # erased with the rest when the op does not use them
        return q_in, k_in, v_in

    def output(self, graph, out, like):
        """The op's (B, H, Sq, Dv) output in the layout ·v produced."""
        if self.merged:
            return insert_call(graph, torch.unflatten, (out, 1, self.merged_sizes), like=like)
        if len(self.canon) == 1:
            return insert_call(graph, torch.squeeze, (out, 0), like=like)
        if self.convert_pv:
            out = insert_call(graph, torch.flatten, (out, 0, 1), like=like)
            if len(self.pv_lead) == 2:
                out = insert_call(graph, torch.unflatten, (out, 0, self.pv_lead), like=like)
        return out


def _log_softmax_of(exp: Node) -> Node | None:
    """The log_softmax node when exp is ``exp(log_softmax(s, dim, dtype))`` (torch.exp, .exp(), of
    torch.log_softmax, F.log_softmax, .log_softmax or torch.special.log_softmax), else None.

    That is softmax(s, dim, dtype): the same dim, and dtype (a cast of s before the reduction) means what
    it means for softmax. Eager computes it in two steps (s - max - log(sum(exp(s - max))), then exp), each
    row the same values up to rounding, NaN on the same rows (every score -inf, or one +inf or NaN)."""
    if op_name(exp) != "exp" or set(exp.kwargs) - {"input"}:  # torch.exp(.., out=buf) writes elsewhere
        return None
    log_softmax = arg(exp, 0, "input")
    return log_softmax if op_name(log_softmax) == "log_softmax" else None


def _rewrite_softmax(graph: Graph, softmax: Node):
    """softmax: an F.softmax / torch.softmax / .softmax call, the division (or multiplication by the
    reciprocal) ending a softmax written out (``exp(..) / ..``, ``exp(..) * (1 / ..)``, see
    _written_out_softmax), exp of a log_softmax (_log_softmax_of) or ``exp(s - logsumexp(s))``
    (_logsumexp_softmax), which then stands for the softmax node throughout.

    The walk may insert nodes before it decides (a split bias's mask, _split_score_bias): a refused attempt
    erases them, and a rewrite places them as it places its own (_settle)."""
    entry = set(graph.nodes)
    try:
        _rewrite_softmax_from(graph, softmax, entry)
    except Exception:
        _roll_back(graph, entry)
        raise


def _rewrite_softmax_from(graph: Graph, softmax: Node, entry: set):
    """_rewrite_softmax, on a graph whose nodes before the attempt are entry."""
    parts = _written_out_parts(softmax) if op_name(softmax) in ("div", "mul") else None
    written_out = parts is not None
    log_softmax = None if written_out else _log_softmax_of(softmax)
    lse = None if written_out or log_softmax is not None else _logsumexp_of(softmax)
    reduction = softmax if log_softmax is None else log_softmax  # the node that names dim and dtype
    # the scores exp or softmax takes (for exp(s - logsumexp(s)) that subtraction, which reaches them);
    # F.softmax(input=s, dim=-1) names them (an IndexError before; review s27, forms)
    if written_out:
        x = arg(parts[0], 0, "input")
    else:
        x = arg(softmax if lse is not None else reduction, 0, "input")
    if not isinstance(x, Node) or tensor_meta(x) is None:
        return
    cand = _Candidate()
    # Only softmaxes that sit between two matmuls are attention candidates worth a report; those over the
    # scores and other columns, whose extra columns are sliced off before ·v (sinks), too.
    joined = _concatenated_scores(x)
    if not _feeds_matmul(softmax, also=("getitem", "narrow") if joined is not None else ()):
        return
    if joined is not None:
        raise _Skip(f"softmax over the scores concatenated with other columns along the key dim "
                    f"('{joined.name}'): the op's softmax runs over the keys of one q·kᵀ alone (attention "
                    "sinks: the probabilities of the keys do not sum to 1, the sink columns take the rest)")
    if not _reaches_matmul(x):
        if _softcapped(x):
            raise _Skip("the scores pass through tanh (logit soft-capping, as in Gemma 2): the op has no "
                        "soft cap")
        return
    softmax_nodes: list[Node] = []
    sm_dtype = None
    if written_out or lse is not None:
        x, softmax_nodes = (_written_out_softmax if written_out else _logsumexp_softmax)(softmax)
        cand.chain.extend(softmax_nodes)
    else:
        ndim = len(_shape(x))
        dim = arg(reduction, 1, "dim")
        # F.softmax / F.log_softmax(input, dim, _stacklevel, dtype); the others (input, dim, dtype)
        is_functional = reduction.op == "call_function" and reduction.target in (
            torch.nn.functional.softmax, torch.nn.functional.log_softmax)
        dtype_pos = 3 if is_functional else 2
        sm_dtype = arg(reduction, dtype_pos, "dtype")
        what = "softmax" if log_softmax is None else "log_softmax"
        if dim is None or norm_dim(dim, ndim) != ndim - 1:
            raise _Skip(f"{what} over dim {dim} of the {ndim}-d scores, not the last (key) dim")
        if log_softmax is not None:
            others = [u.name for u in log_softmax.users if u is not softmax]
            if others:
                raise _Skip(f"the log-probabilities '{log_softmax.name}' have other users "
                            f"({', '.join(others)})")
            softmax_nodes = [log_softmax]  # reads the scores, as the softmax would
            cand.chain.append(log_softmax)
    mm = _scores_side(cand, softmax, x, softmax_nodes)
    _qk(cand, mm)
    cand.masks.check(_shape(mm))  # first: a mask that enlarges the scores explains what follows
    sq, sk = _shape(mm)[-2:]
    dead = cand.masks.constant_dead_row(sq, sk)
    if dead is not None:
        sizes = "" if isinstance(sq, int) and isinstance(sk, int) else " of the example's sizes"
        raise _Skip(f"the constant mask '{dead.name}' leaves a query row with no visible key for every "
                    f"input{sizes}: eager's softmax gives NaN (-inf fill) or the uniform average of v "
                    "(finite fill) there, the op 0")
    row_only = cand.masks.row_only_keep(sk)
    if row_only is not None:
        raise _Skip(f"the mask '{row_only.name}' of shape {list(_shape(row_only))} broadcasts over the key "
                    "dim: it masks whole query rows or nothing, and on each row it masks eager's softmax "
                    "gives NaN (-inf fill) or the uniform average of v (finite fill), the op 0")
    pv, probs = _probs_side(cand, softmax)
    _pv(cand, pv, probs)
    cand.chain.append(softmax)

    # Shapes and dtypes, in (batch..., S, D) layout.
    def laid_out(node, perm, inserted=()):
        shape = _shape(node)
        if shape is None:
            raise _Skip(f"'{node}' has no shape information")
        shape = tuple(shape[p] for p in perm) if perm else shape
        for dim in inserted:
            shape = shape[:dim] + (1,) + shape[dim:]
        return shape

    q_shape, k_shape, v_shape = (
        laid_out(cand.q, cand.q_perm),
        laid_out(cand.k, cand.k_perm, cand.k_unsqueeze),
        laid_out(cand.v, cand.v_perm, cand.v_unsqueeze),
    )
    scores_shape = _shape(mm)
    sm_shape = _shape(x)
    if not (
        _same_dims(sm_shape[-2:], scores_shape[-2:])
        and _holds(_prod(sm_shape[:-2]) == _prod(scores_shape[:-2]))
    ):
        raise _Skip(
            f"the softmax input {list(sm_shape)} is not the shape of the q·kᵀ scores {list(scores_shape)}"
        )
    # Under autocast q·kᵀ and ·v compute in the autocast dtype, casting their operands: the op gets q, k
    # and v cast the same way (review s30: such attention was left alone as "dtypes differ").
    autocast = {}
    for mm_node, operands in ((mm, (cand.q, cand.k)), (pv, (cand.v,))):
        compute = _autocast_dtype(mm_node, operands)
        if compute is not None:
            autocast.update({t: compute for t in operands if _dtype(t) != compute})
    if autocast:
        bias = arg(mm, 0, "input") if op_name(mm) == "baddbmm" else None
        if bias is not None and bias in cand.masks.additive:
            # baddbmm casts its input too: the mask the op adds is that cast
            if _dtype(bias) not in _AUTOCAST_CASTS:
                raise _Skip(f"baddbmm's {_dtype(bias)} input under autocast: autocast leaves it as it is")
            if _dtype(bias) != _dtype(mm):
                cand.masks.casts[bias] = _dtype(mm)
    else:
        _strip_score_upcasts(cand, probs)
    src, k_dtype, v_dtype = (autocast.get(t, _dtype(t)) for t in (cand.q, cand.k, cand.v))
    if not (src == k_dtype == v_dtype == _dtype(pv)):
        raise _Skip(
            f"q, k, v and the output dtypes differ ({src}, {k_dtype}, {v_dtype}, {_dtype(pv)})"
        )
    for node in [n for n in cand.chain if op_name(n) in _CASTS] + ([softmax] if sm_dtype is not None else []):
        if not _precise_enough(_dtype(node), src):
            raise _Skip(f"'{node.name}' casts to {_dtype(node)}, less precise than the {src} inputs")
    if len(q_shape) != cand.batch_dims + 2 or cand.batch_dims < 1:
        raise _Skip(f"attention over {cand.batch_dims} batch dims; the flash op takes (B, H) or (BH)")
    if scores_shape != tuple(q_shape[:-1]) + (k_shape[-2],):
        raise _Skip(
            f"scores {list(scores_shape)} are not (batch..., Sq, Sk) of q {list(q_shape)}, k {list(k_shape)}"
        )
    layout = _Layout(cand, scores_shape, _shape(probs), k_shape, v_shape)
    crossing = state_crossing([*cand.chain, softmax, probs])
    if crossing:
        raise _Skip(crossing)

    # GQA: pass k/v un-repeated when both were repeated alike.
    k_node, v_node = cand.k, cand.v
    enable_gqa = False
    if (
        cand.batch_dims == 2
        and not layout.convert_qk
        and not layout.convert_pv
        and (cand.k_perm or [0, 1, 2, 3])[0] == 0
        and (cand.v_perm or [0, 1, 2, 3])[0] == 0
        and not cand.k_unsqueeze
        and not cand.v_unsqueeze
    ):
        # the heads are dim perm[1] of k / v as given (the op's (B, H, S, D) is k.permute(perm))
        k_base, nk = _unrepeated(cand.k, pv, (cand.k_perm or [0, 1, 2, 3])[1])
        v_base, nv = _unrepeated(cand.v, pv, (cand.v_perm or [0, 1, 2, 3])[1])
        if nk == nv and nk > 1:
            k_node, v_node, enable_gqa = k_base, v_base, True
            k_shape, v_shape = (tuple(_shape(base)[p] for p in perm) if perm else _shape(base)
                                for base, perm in ((k_base, cand.k_perm), (v_base, cand.v_perm)))
    _check_op_limits(*layout.op_shapes(q_shape, k_shape, v_shape), src)
    _check_zeroed_rows(cand)
    for _, factor, stage in cand.q_scales:
        # q·kᵀ's own layout (no view between), and q takes the factor without growing or changing dtype
        t = tensor_meta(factor)
        if not (_same_dims(stage, scores_shape) and _fits(tuple(t.shape), q_shape) and (
            t.dim() == 0 or t.dtype == src
        )):
            raise _Skip(f"the scores' scale '{factor.name}' {list(t.shape)} ({t.dtype}) does not carry over "
                        f"to q {list(q_shape)} ({src})")

    writer = out_writer([*cand.chain, softmax, pv])
    if writer is not None:
        raise _Skip(f"'{writer.name}' also writes its result into out=, which the fused op would not")

    from flash_backend.ops.attention import flash_attention

    before = entry  # what the walk inserted is new too: _settle moves it before the anchor
    try:
        # (autocast's casts: an un-repeated k or v is cast before it is handed to the op)
        q_node, k_node, v_node = (
            insert_call(graph, torch.Tensor.to, (node, autocast[orig]), like=softmax)
            if orig in autocast else node
            for node, orig in ((cand.q, cand.q), (k_node, cand.k), (v_node, cand.v))
        )
        q_in = _permuted(graph, q_node, cand.q_perm, softmax)
        for kind, factor, _ in cand.q_scales:
            q_in = insert_call(graph, torch.mul if kind == "mul" else torch.div, (q_in, factor), like=softmax)
        k_in = _permuted(graph, k_node, cand.k_perm, softmax)
        v_in = _permuted(graph, v_node, cand.v_perm, softmax)
        for dim in cand.k_unsqueeze:
            k_in = insert_call(graph, torch.unsqueeze, (k_in, dim), like=softmax)
        for dim in cand.v_unsqueeze:
            v_in = insert_call(graph, torch.unsqueeze, (v_in, dim), like=softmax)
        q_in, k_in, v_in = layout.inputs(graph, q_in, k_in, v_in, softmax)
        mask, is_causal = cand.masks.build(graph, softmax, scores_shape[-2], scores_shape[-1])
        # A row the finite fill masks entirely: eager's softmax is uniform there (_uniform_masked_rows), and
        # the op gives the mean of v, where it would give 0. Not with an additive mask taken as -inf (eager's
        # row there is not uniform), nor probabilities zeroed after the softmax (eager's row is 0 or less).
        mean_rows = (cand.uniform_masked_rows and mask is not None and not cand.zeroed
                     and cand.masks.assumed_masked is None)
        out = insert_call(
            graph,
            flash_attention,
            (q_in, k_in, v_in),
            {
                **_mask_kwargs(mask, is_causal),
                "dropout_p": cand.dropout_p,
                "scale": cand.scale_arg(graph, softmax),
                "enable_gqa": enable_gqa,
                **({"fully_masked_rows": "mean"} if mean_rows else {}),
            },
            like=softmax,
        )
        out = layout.output(graph, out, softmax)
        if cand.out_perm is not None and cand.out_perm != sorted(cand.out_perm):
            out = insert_call(graph, torch.permute, (out, tuple(cand.out_perm)), like=softmax)
        for cond, _ in cand.zeroed_rows:
            out = insert_call(graph, torch.masked_fill, (out, cond, 0.0), like=softmax)
        _settle(graph, before, pv, {*cand.chain, softmax, pv})
        _check_kept_not_written(graph, before, pv, {*cand.chain, softmax, pv}, pv)
    except Exception:
        _roll_back(graph, before)
        raise
    pv.replace_all_uses_with(out)
    _erase_dead(graph, cand.chain + cand.masks.nodes())
    details = [
        f"scale={cand.scale:.4g}"
        + "".join(f" {'*' if k == 'mul' else '/'} {n.name}" for k, n in cand.symbolic_scales)
        + "".join(f" {'*' if k == 'mul' else '/'} {n.name} (on q)" for k, n, _ in cand.q_scales)
    ]
    if is_causal:
        details.append(_causal_detail(is_causal))
    if cand.masks.assumed_masked is not None:
        details.append(f"additive {cand.masks.assumed_masked:.3g} taken as -inf")
    if mask is not None:
        details.append(f"mask {list(_shape(mask) or [])}")
    for split_shape, n_terms in cand.split_biases:
        details.append(f"{n_terms} bias term{'s' if n_terms > 1 else ''} added to the scores split as "
                       f"{list(split_shape)}")
    if isinstance(cand.dropout_p, Node) or cand.dropout_p:
        details.append(f"dropout={cand.dropout_p}")
    if enable_gqa:
        details.append("gqa")
    if cand.zeroed:
        details.append("probabilities zeroed at the masked keys after the softmax")
    if cand.zeroed_rows:
        details.append("rows zeroed after the softmax: the output's rows zeroed")
    # A post-softmax zeroing by the only mask there is makes every row with no visible key 0 in eager too
    whole = bool(cand.zeroed) and not cand.masks.additive and len(cand.masks.keeps) == 1 and not is_causal
    if cand.finite_fills and mean_rows:
        details.append(f"fill {min(cand.finite_fills):.3g} taken as -inf, a row with every key masked "
                       "given the mean of v as in eager" + (" (undropped)" if cand.dropout_p else ""))
    elif cand.finite_fills and not whole:
        # eager's average on such a row is uniform for one fill (given above where _uniform_masked_rows tells
        # it); two fills that add (a padding finfo.min added after a causal finfo.min fill) overflow to -inf
        # on some keys, and the average is over the others
        details.append(f"fill {min(cand.finite_fills):.3g} taken as -inf: a row with every key masked "
                       "gives 0, where eager gives an average of v")
    if cand.inf_fill and mask is not None and not whole:
        details.append("-inf fill: a row with every key masked gives 0, where eager gives NaN")
    if written_out:
        kind = "exp/sum softmax" if parts[2] is None else "exp·(1/sum) softmax"
    else:
        kind = ("log_softmax.exp" if log_softmax is not None else "exp(s - logsumexp) softmax"
                if lse is not None else "softmax")
    pattern = f"{kind}({cand.variant})"
    record_rewrite(FAMILY, pattern, f"flash_attention({', '.join(details)})", softmax)


def _erase_dead(graph: Graph, roots):
    """Erase the matched nodes left without users, and the pure subgraphs only they used (a mask
    folded into is_causal leaves its factories behind)."""
    pending = [r for r in roots if isinstance(r, Node)]
    while pending:
        node = pending.pop()
        if getattr(node, "_erased", False) or node.users or node.op not in ("call_function", "call_method"):
            continue
        if is_in_place(node):
            continue
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        pending.extend(inputs)


def _roll_back(graph: Graph, before: set):
    """Erase what a rewrite attempt inserted (the nodes not in before), latest first."""
    for n in reversed([n for n in graph.nodes if n not in before]):
        if not n.users:
            graph.erase_node(n)


# Results that alias their argument only sometimes, and copy it otherwise: ``k[:, :, None].expand(..)
# .reshape(..)`` (repeat_kv, litgpt's GQA) is a copy made where the reshape runs.
_MAY_COPY = ("reshape", "reshape_as", "flatten", "ravel", "contiguous", "cpu", "cuda")


def _first_read(node: Node, relevant: set, order: dict, depth: int = 16) -> float:
    """The position of the first node in relevant that reads node's values: a view reads them where its
    own readers do (a cast to another dtype copies, and so may a reshape: it reads them where it runs), a
    write into node is no read of it."""
    first = math.inf
    for user in node.users:
        if user not in relevant:
            continue
        if (is_in_place(user) and user.args and user.args[0] is node) or user.kwargs.get("out") is node:
            continue
        if depth and _is_alias_of_arg0(user) and user.args[0] is node and _dtype(user) == _dtype(node) \
                and op_name(user) not in _MAY_COPY:
            first = min(first, _first_read(user, relevant, order, depth - 1))
        else:
            first = min(first, order[user])
    return first


def _settle(graph: Graph, before: set, anchor: Node, pattern: set):
    """Move the nodes a rewrite inserted (those not in before) to just before anchor, the pattern's last
    node, and prove that they read there what the pattern read where it ran; else raise _Skip.

    insert_call puts each new node right after its inputs, which may be before an in-place write to them
    that the pattern comes after: a KV cache updated in place (``cache[:, :, pos] = k``, ``index_copy_``)
    or a mask built by item assignment, then read by the attention. At the anchor the op sees those writes
    as the pattern did. It would also see a write between a read of the pattern and the anchor (``v`` written
    between the softmax and ``p @ v``, ``q`` after ``q @ kᵀ``), which the pattern did not see: refused."""
    new = [n for n in graph.nodes if n not in before]
    new_set = set(new)
    inputs = {x for n in new for x in n.all_input_nodes if x not in new_set}
    # every write into x's memory, also through the result of an in-place call on it (``kc = cache.mul_(1);
    # q @ kc.mT ..; kc[..., 0] = 0`` was fused with the write moved before the read of k; review s29)
    writes = {x: in_place_writers(x, pattern | new_set) for x in inputs}
    if any(writes.values()):
        order = {n: i for i, n in enumerate(graph.nodes)}
        # what the pattern's value depends on: the pattern and its ancestors (a mask's factors, k before its
        # heads were repeated); reads by other nodes do not matter
        relevant, pending = set(), [n for n in pattern if n in order]
        while pending:
            n = pending.pop()
            if n in relevant or n in new_set:
                continue
            relevant.add(n)
            pending.extend(n.all_input_nodes)
        for x, writers in writes.items():
            first = _first_read(x, relevant, order)
            for w in writers:
                if first < order[w] < order[anchor]:
                    raise _Skip(f"'{x.name}' is written in place by '{w.name}' after the attention reads it "
                                "and before its end: one fused call cannot read both values")
    for n in new:
        anchor.prepend(n)


# Results that are always views of their first argument (they share its version counter).
_PURE_VIEWS = ("transpose", "permute", "t", "view", "unsqueeze", "squeeze", "expand", "detach", "swapaxes",
               "swapdims", "movedim", "moveaxis", "unflatten")


def _view_base(node: Node) -> Node:
    while (node.op == "call_function" and node.target is getattr and node.args[1] in ("mT", "T")) or \
            op_name(node) in _PURE_VIEWS and node.args and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def _eager_keeps(node: Node, pattern: set) -> bool:
    """Whether eager's q·kᵀ or p·v matmul in pattern keeps (for its backward) a tensor sharing node's
    memory's version counter, so that a write to it after the attention fails eager's backward as it fails
    the op's: leaving it unfused would change nothing (a static KV cache written after a trained q reads
    it). Asked of torch itself: the matmul run on meta tensors of the operands' shapes, strides and
    requires_grad, and whether a write to the operand reaches what it saved (its reshape may copy). False
    where that cannot be told (symbolic sizes, a grad-mode or autocast region)."""
    if state_regions(node.graph) is not None:
        return False
    base = _view_base(node)
    for mm in pattern:
        if op_name(mm) not in ("matmul", "bmm") or len(mm.args) != 2 or mm.kwargs:
            continue
        a, b = mm.args
        for i, operand in enumerate((a, b)):
            if not isinstance(operand, Node) or _view_base(operand) is not base:
                continue
            metas = [tensor_meta(t) for t in (a, b)]
            if any(m is None or not _is_static(m) or not all(isinstance(x, int) for x in m.stride())
                   for m in metas):
                continue
            reals = [torch.empty_strided(tuple(m.shape), m.stride(), dtype=m.dtype, device="meta")
                     .requires_grad_(m.requires_grad) for m in metas]
            saved: list = []

            def pack(t, saved=saved):
                saved.append((t, t._version))
                return t

            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                torch.matmul(*reals) if op_name(mm) == "matmul" else torch.bmm(*reals)
            with torch.no_grad():
                reals[i].add_(0)
            if any(t._version != v for t, v in saved):
                return True
    return False


def _check_kept_not_written(graph: Graph, before: set, anchor: Node, pattern: set, output: Node | None):
    """Refuse (_Skip) a rewrite whose op keeps for its backward a tensor that is written in place after the
    attention (review s29); call after _settle, with the inserted nodes (those not in before) in place.

    flash_attention keeps q, k, v, the mask and its output whenever one of its inputs needs a gradient.
    Eager's unfused ops keep less: q·kᵀ keeps q only for k's gradient and k only for q's, p·v keeps v only
    when the probabilities need a gradient, an additive mask is not kept, nor is the output. So a write after
    the attention that eager trains through, ``q.mul_(2)`` with a frozen (detached) k/v cache, ``v.add_(..)``
    behind the scores of frozen projections, ``mask.zero_()``, ``o = (p @ v).transpose(1, 2); o.mul_(2)``,
    failed the op's backward ("modified by an inplace operation"). Where eager keeps the tensor too (SDPA's
    fused CPU kernel keeps q, k, v and its output) its backward fails alike, and leaving it unfused changes
    nothing. Where nothing is recorded (records_grad: no_grad, nothing needs a gradient) the write is
    harmless. output: the pattern's result, which the op's output replaces (None when the op's output
    reaches no reader as itself or a view: MultiheadAttention's out-projection reads it)."""
    if not records_grad(anchor):
        return
    from flash_backend.ops.attention import flash_attention

    order = {n: i for i, n in enumerate(graph.nodes)}
    new = [n for n in graph.nodes if n not in before]
    allowed = set(pattern) | set(new)
    kept = [("the output", output)] if output is not None else []
    for call in (n for n in new if n.op == "call_function" and n.target is flash_attention):
        kept += [("q", arg(call, 0, "q")), ("k", arg(call, 1, "k")), ("v", arg(call, 2, "v")),
                 ("the mask", arg(call, 3, "attn_mask"))]
    for what, node in kept:
        if not isinstance(node, Node):
            continue
        writers = [w for w in in_place_writers(node, allowed) if order[w] > order[anchor]]
        if writers and not _eager_keeps(node, pattern):
            w = writers[0]
            raise _Skip(f"{what} '{node.name}' of the attention is written in place by '{w.name}' after it: "
                        "the fused op keeps it for its backward, which would then fail where eager's "
                        "unfused ops, which do not keep it here, train")


def _sdpa_backend_when_traced(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, autocast=None):
    """The backend SDPA picks for these example (fake) inputs, as it does when Inductor traces the call;
    None when that cannot be asked (non-constant arguments, a build without the device's kernels).

    Why ask: under torch.compile the choice is made on fake tensors, and there it can differ from eager.
    On the H200 (torch 2.11), ViT-base's SDPA call (64, 12, 197, 64) picks cuDNN on real tensors but the
    unfused math path on fake ones (bench/NOTES_attention.md, session 3), which upcasts to fp32 and
    materialises the S x S scores: Inductor's ViT step then ran slower than eager. Routing those calls
    measured (e2e.json, df775ed) ViT 1.46x Inductor; GPT-2 and BERT, also answered MATH, 1.00x / 0.98x."""
    args = [val(n) for n in (q, k, v, attn_mask, dropout_p, scale)]
    if not all(isinstance(t, torch.Tensor) for t in args[:3]) or not isinstance(is_causal, bool):
        return None
    if args[3] is not None and not isinstance(args[3], torch.Tensor):
        return None
    if not is_number(args[4]) or not (args[5] is None or is_number(args[5])):
        return None
    try:
        if autocast is not None:  # the dtype SDPA sees at run time (autocast's casts)
            args[:4] = [t.to(autocast) if isinstance(t, torch.Tensor) and t.dtype in _AUTOCAST_CASTS else t
                        for t in args[:4]]
        choice = torch._fused_sdp_choice(*args[:3], args[3], float(args[4]), is_causal,
                                         scale=None if args[5] is None else float(args[5]),
                                         enable_gqa=bool(enable_gqa))
        return torch.nn.attention.SDPBackend(choice)
    except Exception as exc:  # e.g. no CUDA kernels in this build: treat as "fused", the safe default
        log.debug("flash_backend: could not ask SDPA for its backend choice: %s", exc)
        return None


# Floating dtypes autocast casts to its lower-precision dtype (it leaves float64 as it is).
_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)


def _autocast_dtype(node: Node, operands) -> torch.dtype | None:
    """The dtype node (q·kᵀ, ·v, an SDPA call) computes in under autocast: a half-precision dtype it returns
    from operands of which some have another float32 / float16 / bfloat16 dtype, which autocast casts to it.
    Only autocast does that (these ops refuse operands of mixed dtypes and return theirs). Else None, and the
    callers' dtype checks decide (``torch.bmm(.., out_dtype=torch.float32)`` returns a higher one)."""
    out = _dtype(node)
    dtypes = {_dtype(t) for t in operands}
    if out not in (torch.float16, torch.bfloat16) or dtypes == {out} or not dtypes <= set(_AUTOCAST_CASTS):
        return None
    return out


def _rewrite_sdpa(graph: Graph, node: Node):
    q, k, v = (arg(node, i, n) for i, n in ((0, "query"), (1, "key"), (2, "value")))
    attn_mask = arg(node, 3, "attn_mask")
    dropout_p = arg(node, 4, "dropout_p", 0.0)
    is_causal = arg(node, 5, "is_causal", False)
    scale = arg(node, 6, "scale")
    enable_gqa = node.kwargs.get("enable_gqa", node.args[7] if len(node.args) > 7 else False)
    if not all(isinstance(t, Node) and tensor_meta(t) is not None for t in (q, k, v)):
        raise _Skip("q, k, v are not tensors")
    variant = "scaled_dot_product_attention"
    # Under autocast SDPA casts q, k and v (also of different dtypes: q and k normed in fp32, v not)
    compute = _autocast_dtype(node, (q, k, v))
    if compute is None and not (_dtype(q) == _dtype(k) == _dtype(v)):
        raise _Skip("q, k, v dtypes differ")
    if tensor_meta(q).device.type == "cuda" and not flash_config.route_sdpa_calls_on_cuda:
        backend = _sdpa_backend_when_traced(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                            compute)
        if backend is None or backend != torch.nn.attention.SDPBackend.MATH:
            raise _Skip(
                f"SDPA runs a fused CUDA kernel here ({backend.name if backend is not None else 'unknown'}) "
                "that flash_attention does not beat yet (see flash_backend/config.py; set "
                "route_sdpa_calls_on_cuda=True to route it)"
            )
        variant = "scaled_dot_product_attention (traced, SDPA would pick its unfused math path)"
    symbolic_p = isinstance(dropout_p, Node) and isinstance(val(dropout_p), (float, torch.SymFloat))
    if (
        not (is_number(dropout_p) or symbolic_p)
        or not isinstance(is_causal, bool)
        or not isinstance(enable_gqa, bool)
    ):
        raise _Skip("dropout_p, is_causal or enable_gqa is not a compile-time constant")
    if scale is not None:
        scale = _scalar_factor(scale)
        if scale is None:
            raise _Skip("scale is neither a number nor a symbolic scalar")
    q_shape, k_shape, v_shape = _shape(q), _shape(k), _shape(v)
    ndim = len(q_shape)
    if ndim < 3 or len(k_shape) != ndim or len(v_shape) != ndim:
        raise _Skip(f"{ndim}-d inputs; the flash op takes (B, H, S, D)")
    merged_lead = None
    if ndim > 4:
        # More than two batch dims (timm Twins' LocallyGroupedAttn: (B, windows, heads, ws², d)): SDPA runs
        # each (batch..., query) row over the keys of the same batch index, so the op runs on q, k, v
        # flattened to (B, prod(rest), S, D) and its output is unflattened back, as the manual path does
        # (_Layout._merge). Only where q, k, v hold every batch index themselves (no broadcast among them)
        # and the mask, if any, broadcasts over every batch dim.
        merged_lead = q_shape[:-2]
        mask_shape = _shape(attn_mask) if isinstance(attn_mask, Node) else ()
        if not (_same_dims(k_shape[:-2], merged_lead) and _same_dims(v_shape[:-2], merged_lead)):
            raise _Skip(f"{ndim}-d inputs merged into the op's (B, H) only where q, k, v hold every batch "
                        f"index (q {list(q_shape)}, k {list(k_shape)}, v {list(v_shape)})")
        if enable_gqa:
            raise _Skip(f"{ndim}-d inputs with enable_gqa")
        if mask_shape is None or len(mask_shape) > 4 or not all(_holds(d == 1) for d in mask_shape[:-2]):
            raise _Skip(f"{ndim}-d inputs merged into the op's (B, H) only with a mask that broadcasts over "
                        f"every batch dim: attn_mask {list(mask_shape or [])}")
        q_shape, k_shape, v_shape = ((s[0], _prod(s[1:-2])) + tuple(s[-2:])
                                     for s in (q_shape, k_shape, v_shape))
        ndim = 4
    if ndim == 3:
        q_shape, k_shape, v_shape = ((1,) + s for s in (q_shape, k_shape, v_shape))
    dtype = _dtype(q)
    if compute is not None:
        # Under autocast (a region in the graph, or entered around the compiled call) SDPA casts q, k, v and
        # a float attn_mask to the autocast dtype and returns that dtype; the op, which autocast does not
        # touch, gets them cast the same way in the graph (review s30: it ran in fp32 and returned fp32
        # where eager returns bfloat16).
        variant += f" (autocast to {str(compute).removeprefix('torch.')})"
        dtype = compute
    unrepeated = False
    if ndim == 4 and _holds(k_shape[1] == q_shape[1]):
        # k / v repeated to q's heads before the call (litgpt's expand + reshape, repeat_kv,
        # repeat_interleave over the heads): the op takes them un-repeated, as GQA (_unrepeat proves the
        # pairing), and reads G heads instead of H
        (k_base, nk), (v_base, nv) = _unrepeated(k, node), _unrepeated(v, node)
        if nk == nv and nk > 1:
            k, v, enable_gqa, unrepeated = k_base, v_base, True, True
            k_shape, v_shape = _shape(k), _shape(v)
    if k_shape[1] != q_shape[1] and not enable_gqa:
        if not (_holds(k_shape[1] == 1) and _holds(v_shape[1] == 1)):
            raise _Skip("k/v heads differ from q heads without enable_gqa (SDPA raises)")
        # One k/v head broadcast over q's heads (Falcon's multi-query SDPA call): SDPA broadcasts the
        # head dim like a batch dim, the same function as GQA with one group.
        enable_gqa = True
    _check_op_limits(q_shape, k_shape, v_shape, dtype)
    if not symbolic_p and not 0.0 <= dropout_p < 1.0:
        raise _Skip(f"dropout_p={dropout_p} outside [0, 1)")
    masks = _Masks()
    scores_shape = (q_shape[0], q_shape[1], q_shape[2], k_shape[2])
    if attn_mask is not None:
        if not isinstance(attn_mask, Node):
            raise _Skip("attn_mask is not a tensor")
        if is_causal:
            raise _Skip("both attn_mask and is_causal (SDPA raises)")
        if ndim == 3 and len(_shape(attn_mask) or ()) > 3:
            raise _Skip("4-d mask with 3-d inputs")
        (
            masks.keeps.append((attn_mask, False))
            if _dtype(attn_mask) == torch.bool
            else masks.additive.append(attn_mask)
        )
        if compute is not None and _dtype(attn_mask) != torch.bool and _dtype(attn_mask) != compute:
            if _dtype(attn_mask) not in _AUTOCAST_CASTS:
                raise _Skip(f"a {_dtype(attn_mask)} attn_mask under autocast: autocast leaves it as it is")
            masks.casts[attn_mask] = compute  # the values autocast hands SDPA
        masks.check(scores_shape)
        # A float mask that leaves a query row without a key: eager SDPA gives the average of v there with a
        # finite fill (finfo.min), the op 0. Checked as the softmax path does, so also at the other sizes a
        # dynamic-shape graph is reused for (a bottom-right band built at Sq <= Sk, called at Sq > Sk). A
        # bool mask's dead rows are 0 in eager SDPA too.
        dead = masks.constant_dead_row(scores_shape[2], scores_shape[3]) if masks.additive else None
        if dead is not None:
            raise _Skip(f"the constant attn_mask '{dead.name}' leaves a query row with no visible key: eager "
                        "SDPA gives the average of v there with a finite fill, the op 0")

    from flash_backend.ops.attention import flash_attention

    before = set(graph.nodes)
    try:
        if compute is not None:
            q, k, v = (insert_call(graph, torch.Tensor.to, (t, compute), like=node) for t in (q, k, v))
        if ndim == 3:
            q, k, v = (insert_call(graph, torch.unsqueeze, (t, 0), like=node) for t in (q, k, v))
        if merged_lead is not None:
            (q, k, v), merged_sizes = _merge_batch_dims(graph, q, (q, k, v), merged_lead, node)
        mask, causal_from_mask = masks.build(graph, node, scores_shape[2], scores_shape[3])
        out = insert_call(
            graph,
            flash_attention,
            (q, k, v),
            {
                **_mask_kwargs(mask, is_causal or causal_from_mask),
                "dropout_p": dropout_p if symbolic_p else float(dropout_p),
                "scale": scale,
                "enable_gqa": enable_gqa,
            },
            like=node,
        )
        if ndim == 3:
            out = insert_call(graph, torch.squeeze, (out, 0), like=node)
        if merged_lead is not None:
            out = insert_call(graph, torch.unflatten, (out, 1, merged_sizes), like=node)
        _settle(graph, before, node, {node})
        _check_kept_not_written(graph, before, node, {node}, node)
    except Exception:
        _roll_back(graph, before)
        raise
    node.replace_all_uses_with(out)
    _erase_dead(graph, [node])
    details = ([f"{len(merged_lead) + 2}-d inputs merged to (B, H)"] if merged_lead is not None else []) + (
        ["causal bottom-right, from attn_mask"] if causal_from_mask == BOTTOM_RIGHT else []) + (
        [f"causal from attn_mask, {masks.assumed_masked:.3g} taken as -inf"]
        if masks.assumed_masked is not None else []) + (["gqa: k/v un-repeated"] if unrepeated else [])
    record_rewrite(FAMILY, variant,
                   f"flash_attention({', '.join(details)})" if details else "flash_attention", out)


# The symbols of dynamo's float inputs (zf0, ...) whose value a rewrite of this run baked in; see rewrite().
_float_inputs_to_specialise: list = []


def _mha_dropout_p(p) -> tuple[float, set | None]:
    """MultiheadAttention's dropout_p in training, a number in [0, 1), and the float-input symbols it is
    made of when dynamic=True made it a graph input (None for a number). Its value is baked into the op
    call: those symbols are specialised (a guard, and dynamo's analysis restarted with them constants, as
    the norm and dense passes do for the floats they bake in)."""
    symbols = None
    if isinstance(p, Node):
        symbols = float_input_symbols(val(p))
        if symbols is None:
            raise _Skip("dropout_p is neither a number nor a float input (dropout_p in [0, 1))")
        p = float(val(p))  # guards on its value
    if not (is_number(p) and 0 <= p < 1):
        raise _Skip(f"dropout_p={p} in training is not a number in [0, 1)")
    return float(p), symbols


def _rewrite_mha(graph: Graph, node: Node):
    """nn.MultiheadAttention (F.multi_head_attention_forward, (L, N, E) inputs) -> its in-projection,
    flash_attention over (N, H, L, D) and its out-projection: the same function, written out."""
    a = bound_arguments(node, torch.nn.functional.multi_head_attention_forward)
    if a is None:
        raise _Skip("cannot read the arguments of F.multi_head_attention_forward")
    query, key, value = a["query"], a["key"], a["value"]
    if not all(isinstance(t, Node) and len(_shape(t) or ()) == 3 for t in (query, key, value)):
        raise _Skip("unbatched (2-d) or non-tensor query/key/value")
    unsupported = [name for name in ("bias_k", "bias_v", "static_k", "static_v") if a[name] is not None]
    unsupported += [name for name in ("add_zero_attn",) if a[name]]
    flags = ("is_causal", "need_weights", "use_separate_proj_weight", "training")
    if not all(isinstance(a[name], bool) for name in flags):
        unsupported.append("a non-constant is_causal, need_weights, use_separate_proj_weight or training")
    # fairseq's MultiheadAttention (and nn.MultiheadAttention with kdim / vdim) passes q, k and v's own
    # projection weights, in_proj_bias the three biases concatenated: eager's _in_projection is then
    # F.linear(x, w_x, b_x) for each, what the rewrite writes out below
    separate = a["use_separate_proj_weight"] is True
    projections = [a[f"{x}_proj_weight"] for x in "qkv"] if separate else [a["in_proj_weight"]]
    if not all(isinstance(w, Node) and len(_shape(w) or ()) == 2 for w in projections):
        unsupported.append("a projection weight that is not a 2-d tensor")
    if unsupported:
        raise _Skip(f"{', '.join(unsupported)} not supported by the rewrite")
    if any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
        raise _Skip("the attention weights are used (need_weights)")
    heads, embed = a["num_heads"], a["embed_dim_to_check"]
    length, batch, width = _shape(query)
    src_len = _shape(key)[0]
    if not (isinstance(heads, int) and isinstance(embed, int) and _holds(width == embed)) or embed % heads:
        raise _Skip("num_heads or embed_dim is not a constant that divides the embedding")
    # it drops only in training: in eval any p is eager's 0 (under dynamic=True the module's float is a
    # symbolic input, specialised only where it matters)
    dropout_p, p_symbols = (_mha_dropout_p(a["dropout_p"]) if a["training"] else (0.0, None))
    if tensor_meta(query).device.type == "cuda" and not a["need_weights"] and \
            not flash_config.route_sdpa_calls_on_cuda:
        raise _Skip("with need_weights=False MultiheadAttention runs SDPA's fused CUDA kernels, which "
                    "flash_attention does not beat yet (flash_backend/config.py, route_sdpa_calls_on_cuda)")
    dtype, head_dim = _dtype(query), embed // heads
    if not (dtype == _dtype(key) == _dtype(value)):
        raise _Skip("query, key, value dtypes differ")
    shape4 = (batch, heads, length, head_dim)
    _check_op_limits(shape4, (batch, heads, src_len, head_dim), (batch, heads, src_len, head_dim), dtype)
    masks = _Masks()
    for name in ("key_padding_mask", "attn_mask"):
        mask = a[name]
        if mask is not None and (not isinstance(mask, Node) or _shape(mask) is None):
            raise _Skip(f"{name} is not a tensor")
    kpm, attn_mask = a["key_padding_mask"], a["attn_mask"]
    # is_causal is a hint that attn_mask is the causal mask (TransformerEncoderLayer(is_causal=True),
    # TransformerDecoderLayer(tgt_is_causal=True)). Eager takes it only without a key_padding_mask and
    # without need_weights: it then drops attn_mask and runs SDPA with is_causal=True (top-left), whatever
    # the mask holds; otherwise it ignores the hint and applies the mask (review s29: every such layer was
    # left alone). The rewrite does what eager does, in each case.
    hinted_causal = a["is_causal"] and kpm is None and not a["need_weights"]
    if a["is_causal"] and attn_mask is None:
        raise _Skip("is_causal without attn_mask (MultiheadAttention raises)")
    if hinted_causal:
        attn_mask = None
    if kpm is not None and len(_shape(kpm)) != 2:
        raise _Skip(f"key_padding_mask of shape {list(_shape(kpm))}, not (N, S)")
    if attn_mask is not None and len(_shape(attn_mask)) not in (2, 3):
        raise _Skip(f"attn_mask of shape {list(_shape(attn_mask))}, not (L, S) or (N * num_heads, L, S)")

    before = set(graph.nodes)

    def call(fn, args, kwargs=None):
        return insert_call(graph, fn, args, kwargs or {}, like=node)

    def size(t, dim):
        # a symbolic size (dynamic=True) as a node of the graph, as the softmax path passes them
        d = _shape(t)[dim]
        return d if isinstance(d, int) else call(torch.ops.aten.sym_size.int, (t, dim))

    try:
        n_query, n_batch, n_key = size(query, 0), size(query, 1), size(key, 0)
        for mask, view in ((kpm, (n_batch, 1, 1, n_key)), (attn_mask, (n_batch, heads, n_query, n_key))):
            if mask is None:
                continue
            if len(_shape(mask)) != 2 or mask is kpm:
                mask = call(torch.reshape, (mask, view))
            # MultiheadAttention's bool masks mark what is masked out; float masks are added.
            masks.keeps.append((mask, True)) if _dtype(mask) == torch.bool else masks.additive.append(mask)
        masks.check((batch, heads, length, src_len))
        # A constant mask that leaves a query row without a key (``triu(full(-inf), diagonal=0)``, one off):
        # with need_weights (the default) MultiheadAttention's own softmax gives NaN there (-inf, or a bool
        # mask, which it turns into -inf) and with a finite fill the average of v; without it SDPA gives 0
        # for -inf and bool masks. The op gives 0: refused where eager differs for every input, as the
        # softmax and SDPA paths do (review s27).
        dead = masks.constant_dead_row(length, src_len)
        if dead is not None and (a["need_weights"] is not False or masks.additive):
            raise _Skip(f"the constant mask '{dead.name}' leaves a query row with no visible key: eager "
                        "MultiheadAttention gives NaN (need_weights) or the average of v (finite fill) "
                        "there, the op 0")
        bias = a["in_proj_bias"]
        if not separate and key is query and value is query:
            qkv = call(torch.nn.functional.linear, (query, projections[0], bias))
            projected = [call(operator.getitem, (call(torch.chunk, (qkv, 3, -1)), i)) for i in range(3)]
        else:
            if not separate:
                chunks = call(torch.chunk, (projections[0], 3))
                projections = [call(operator.getitem, (chunks, i)) for i in range(3)]
            biases = call(torch.chunk, (bias, 3)) if bias is not None else None
            projected = [call(torch.nn.functional.linear,
                              (x, w, call(operator.getitem, (biases, i)) if biases is not None else None))
                         for i, (x, w) in enumerate(zip((query, key, value), projections, strict=True))]
        # (S, N, E) -> (N, H, S, D)
        q, k, v = (call(torch.permute, (call(torch.reshape, (t, (n, n_batch, heads, head_dim))),
                                        (1, 2, 0, 3)))
                   for t, n in zip(projected, (n_query, n_key, n_key), strict=True))
        mask, causal = masks.build(graph, node, length, src_len)
        causal = causal or hinted_causal
        from flash_backend.ops.attention import flash_attention

        out = call(flash_attention, (q, k, v), {**_mask_kwargs(mask, causal), "dropout_p": dropout_p})
        out = call(torch.reshape, (call(torch.permute, (out, (2, 0, 1, 3))), (n_query, n_batch, embed)))
        out = call(torch.nn.functional.linear, (out, a["out_proj_weight"], a["out_proj_bias"]))
        want = tensor_meta(node.users and next(iter(node.users)))
        got = tensor_meta(out)
        if want is not None and (got is None or (got.dtype, got.shape) != (want.dtype, want.shape)):
            raise _Skip("the written-out attention would differ in dtype or shape from MultiheadAttention's")
        _settle(graph, before, node, {node})
        _check_kept_not_written(graph, before, node, {node}, None)
    except Exception:
        _roll_back(graph, before)  # what this attempt inserted (masks.build's nodes too)
        raise
    for user in list(node.users):
        user.replace_all_uses_with(out)
    _erase_dead(graph, [node, *node.users])
    if p_symbols:
        _float_inputs_to_specialise.extend(p_symbols)
    details = (["causal bottom-right, from attn_mask"] if causal == BOTTOM_RIGHT else []) + (
        [f"causal from attn_mask, {masks.assumed_masked:.3g} taken as -inf"]
        if masks.assumed_masked is not None else [])
    record_rewrite(FAMILY, "nn.MultiheadAttention (F.multi_head_attention_forward)",
                   f"flash_attention({', '.join(details)})" if details else "flash_attention", out)


def rewrite(graph: torch.fx.Graph) -> None:
    _float_inputs_to_specialise.clear()
    functionalize_in_place(graph)  # run_passes did it already; again when the family runs alone
    for node in list(graph.nodes):
        if getattr(node, "_erased", False) or node.op not in ("call_function", "call_method"):
            continue
        name = op_name(node)
        if node.op == "call_function" and node.target is torch.special.softmax:  # (input, dim, *, dtype)
            name = "softmax"
        # a division of exp(..), or a product of exp(..) and a reciprocal: maybe softmax written out by hand
        # (exp / its sum, exp * (1 / its sum)), the same candidate
        written_out = name in ("div", "mul") and _written_out_parts(node) is not None
        if name == "exp" and _log_softmax_of(node) is not None:
            name = "log_softmax.exp"  # softmax spelled exp(log_softmax(..)), the same candidate
        elif name == "exp" and _logsumexp_of(node) is not None:
            name = "logsumexp.exp"  # softmax spelled exp(s - logsumexp(s)), the same candidate
        if not written_out and name not in ("softmax", "sdpa", "multi_head_attention_forward",
                                            "log_softmax.exp", "logsumexp.exp"):
            continue
        variant = {"sdpa": "scaled_dot_product_attention", "softmax": "softmax attention",
                   "multi_head_attention_forward": "nn.MultiheadAttention",
                   "div": "softmax attention (softmax written out, exp / sum)",
                   "mul": "softmax attention (softmax written out, exp * (1 / sum))",
                   "log_softmax.exp": "softmax attention (softmax as log_softmax(..).exp())",
                   "logsumexp.exp": "softmax attention (softmax as exp(s - logsumexp(s)))"}[name]
        name = "softmax" if written_out or name in ("log_softmax.exp", "logsumexp.exp") else name
        try:
            if name == "sdpa":
                _rewrite_sdpa(graph, node)
            elif name == "softmax":
                _rewrite_softmax(graph, node)
            else:
                _rewrite_mha(graph, node)
        except _Skip as skip:
            record_near_miss(FAMILY, variant, str(skip), node)
        except Exception as error:  # noqa: BLE001 - a matcher bug must cost a fusion, never the compile
            log.warning("attention pass: %s failed on %s", variant, node.name, exc_info=True)
            record_near_miss(FAMILY, variant, f"internal error {type(error).__name__}: {error}", node)
    if _float_inputs_to_specialise:
        # dynamic=True made a MultiheadAttention's dropout p (a module float) a graph input and a training
        # rewrite baked its value in: restart dynamo's analysis with it a constant, as the norm and dense
        # passes do; the decisions of this run are not counted (fx_passes/_report.py: committed_only).
        # Dynamo throws this graph away on the restart, erasing it last node first, which fails on a node
        # still read by one placed before it: the rewrites insert their calls after their inputs, ahead of
        # run_passes' final sort (review s32, W1).
        stable_topological_sort(graph)
        restart_with_specialised_floats(_float_inputs_to_specialise)
