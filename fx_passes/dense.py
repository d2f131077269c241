"""Dense family: Linear (F.linear / nn.Linear / torch.addmm) followed by GELU -> flash linear_bias_gelu.

Why: in eager and in Inductor the GELU after a Linear is a separate pass over the (M, N) activations
forward and another backward, and the bias gradient a separate reduction; the fused op runs the bias,
the (tanh) GELU and the store of the pre-activation in the GEMM's epilogue, and the bias gradient in
the weight-gradient GEMM (flash_backend/ops/dense.py).

What is matched, on the Torch IR dynamo produces (before AOTAutograd, so the op's autograd gives the
backward): ``F.linear(x, w, b)`` (nn.Linear; arguments by position or keyword), or ``torch.addmm(b, x, m)`` or
``b.addmm(x, m)`` with default alpha/beta (transformers' Conv1D in GPT-2: m is (K, N), optionally followed by
a ``view`` back to (..., N); addmm's deprecated positional beta/alpha overloads are refused), or a matmul with
a 2-d right operand (``x @ w.t()``, ``w.T``, ``w.mT``, ``torch.mm``, ``x @ m`` with m (K, N); Tensor methods
too: ``x.matmul(..)``, ``x.mm(..)``, ``h.add(b)``), or a two-operand ``torch.einsum`` that is one
(``'bsk,nk->bsn'``, ``'...k,kn->...n'``, either operand order: x's last index contracted with the 2-d
operand's, the output x's other indices in order and then the free one; nothing else), followed by a GELU of
that output (the ``torch.ops.aten`` spellings of linear, addmm, mm, matmul and gelu too: _ATEN). Between the
two, any number of ``+ b`` with b a tensor of shape (N,) (either side of the add, no alpha) are taken into the
op's bias: the bias of a bias-free Linear (``F.linear(x, w) + b``, ``nn.Linear(bias=False)(x) + b``,
``x @ w.t() + b``), and a second bias on a biased one (``lin(x) + b2``), passed as ``b + b2`` computed in the
graph (autograd takes its gradient to both).

That is the same function. In exact arithmetic linear(x, w, b) + b2 is linear(x, w, b + b2). In floating
point eager rounds twice, round(round(acc + b) + b2), the rewrite round(acc + round(b + b2)); each is one
rounding of an intermediate (|acc + b| in eager, |b + b2| here) away from the exact value, and neither is
bitwise the other. That is the tolerance every rewrite here already takes: ``x @ w.t() + b`` in bf16 rounds
the matmul before the add in eager and not in the fused epilogue, and the erf GELU written out rounds at each
of its ops. tests/test_dense_pass_more_forms.py measures the bf16 case against fp64: the rewrite is as
close to the exact function as eager. A bias whose dtype differs from the Linear's (eager promotes) is not
taken: the op's own dtype check reports it.

The GELU after it:

- ``F.gelu(h)`` / ``nn.GELU`` / transformers' GELUActivation, with its ``approximate`` kept exactly;
- GELU written out (transformers' NewGELUActivation / gelu_new / FastGELU tanh forms,
  ``x * 0.5 * (1 + erf(x / sqrt(2)))``, ``0.5 * x * erfc(-x / sqrt(2))``): any subgraph of pointwise
  ``mul/add/sub/div/pow/neg/square`` with constant scalars and exactly one ``tanh`` (torch or F), ``erf`` or
  ``erfc`` (torch, Tensor method or torch.special) or ``torch.special.ndtr`` (the normal CDF: ``h * ndtr(h)``
  is the erf GELU), fed by h alone, that evaluates (in fp64, on a grid over
  [-8, 8] and out to +-1e8) to the tanh or the erf GELU to 1e-9, and in h's own dtype to within rounding (a
  constant that under- or overflows there, ``h * 1e-50 * 1e50`` in fp32, is another function; so, in fp64, is
  BLOOM's GELU with sqrt(2 / pi) written to 8 digits, a GELU in fp32 and below only), and that
  neither divides by a value computed from h nor raises one to a negative or fractional power nor a number to
  a power of h: such a term can hide a pole or a spike between the samples (``1e-13 / (h - 0.0045)``), or an
  infinite gradient at 0 (``1e-20 * (h * h) ** 0.1``), so the grid proves nothing there; it is reported
  (_unsampled_pole). Which one it is decides ``approximate``: an erf GELU never
  becomes a tanh one. A float the subgraph computes from dynamo's float inputs alone (dynamic=True makes
  ``math.pi`` in NewGELU's ``math.sqrt(2.0 / math.pi)``, and module float attributes, graph inputs) is read as
  its value and, when the rewrite is made, specialised: dynamo guards on it and retraces with it constant, as
  the norm pass does for eps. A number computed from a size is no such constant.

The GELU may read the pre-activation cast up to fp32 (``F.gelu(lin(x).float())``, as code computing
activations in fp32 writes it) when its fp32 result is cast straight back to the Linear's dtype
(``.to(x.dtype)``, ``.type_as(x)``): the op computes the GELU in fp32 and rounds it once to that dtype, which
is exactly that (_through_upcast). Used in fp32 it is left alone, reported: the op would return it rounded. An
fp32 Linear's ``.float()`` is the identity. The cast back may name the pre-activation itself, fairseq's
``utils.gelu``: ``F.gelu(h.float()).type_as(h)`` and ``F.gelu(h.float()).to(h)`` read h for its dtype only,
so that ``type_as`` / ``to`` is no other reader of h (_dtype_references); in fp32, and after a GELU computed
in h's dtype (``F.gelu(h).to(h)``), it is the identity after the GELU, and it becomes the op's output. A cast
after the GELU to another tensor's dtype, ``.to(t)``, is no reader of h: it stays, reading the op's output,
where it is the same function (the GELU in h's dtype, then cast: ``F.gelu(h).to(t)``), and is left alone,
reported, where it is not (``F.gelu(h.float()).to(t)``, t neither fp32 nor h's dtype: eager rounds the fp32
GELU once to t's dtype, the op to h's).

Under autocast the Linear computes in a lower dtype than its operands, which it casts (x, the weight, and
F.linear's or addmm's own bias), and the GELU runs on its output in that dtype: the rewrite casts the same
operands with ``.to`` in the graph and reports the variant as "(autocast to bfloat16)". Autograd then takes
each cast's gradient back to the fp32 parameter, as eager's autocast does.

Left alone, with the reason reported: a pre-activation (the Linear's output, or the last bias add after it)
with users besides the GELU (it is needed elsewhere), an addmm with alpha/beta, an addmm or a GELU that also
writes its result into an ``out=`` tensor (``torch.addmm(b, x, m, out=buf)``), a tensor the subgraph reads
that is written in place before it ends, under autocast an fp32 bias added after the Linear
(``x @ w.t() + b``, ``lin(x) + b2``: eager's add promotes the output, so the GELU runs in fp32), a GELU
written out with a pole or a spike the grid cannot see, and a candidate whose fused result would differ in
dtype or shape from eager's (checked by running the op on the fake inputs). Left alone without a report,
because they are not a Linear + bias + GELU the pass can prove: ``h - b``, ``torch.add(h, b, alpha=a)``, an
addend of another shape ((1, N), (M, N)), a bias add on a Linear output that is also read elsewhere, a GELU
written with two transcendental calls, sigmoid forms.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from flash_backend import config as flash_config
from fx_passes._compat import (
    float_input_symbols,
    restart_with_specialised_floats,
    stable_topological_sort,
)
from fx_passes._match import (
    arg,
    binary_other,
    erase_unused,
    fake_call,
    fused_op,
    insert_call,
    is_number,
    is_op,
    linear_operand_writer,
    linear_operands,
    op_name,
    out_writer,
    state_crossing,
    tensor_meta,
    val,
    written_before_end,
)
from fx_passes._report import record_near_miss, record_rewrite

FAMILY = "dense"

_OP_MODULE = "flash_backend.ops.dense"
_OP_NAME = "flash.dense_gelu_fwd (linear_bias_gelu)"
_TRANSCENDENTAL = ("tanh", "erf", "erfc", "ndtr")  # ndtr(h) = Phi(h) = (1 + erf(h / sqrt 2)) / 2
_CASTS = {"float", "to", "type", "type_as", "half", "bfloat16"}
# torch.ops.aten's spellings of the ops matched here (``torch.ops.aten.gelu(h)``, ``aten.linear.default``),
# which dynamo records as the op packet or overload itself and _match.op_name does not name: the same
# functions, with the same arguments in the same positions. Only the packet and its .default overload:
# ``.out`` writes into its out= tensor, and addmm / mm ``.dtype`` compute in another dtype.
_ATEN = ("gelu", "linear", "addmm", "mm", "matmul")
_POINTWISE = {"mul", "add", "sub", "div", "pow", "neg", "square", *_TRANSCENDENTAL}
_MAX_WRITTEN_OUT = 16  # nodes of a written-out GELU (NewGELU has 8)
# Where a written-out GELU is compared with F.gelu: densely over [-8, 8], where the two GELUs differ, and at
# magnitudes up to 1e8 either side, where a stray term too small to show on [-8, 8] (1e-15 * x**5) grows;
# and at 0 itself, which linspace misses by 1.7e-16: a formula dividing by h (``h * h / h``) is NaN there,
# in eager too (a zero padding row through a bias-free Linear), and equal to the GELU everywhere else.
_WIDE = torch.logspace(-8.0, 8.0, 161, dtype=torch.float64)
_GRID = torch.cat([torch.linspace(-8.0, 8.0, 2001, dtype=torch.float64), _WIDE, -_WIDE,
                   torch.zeros(1, dtype=torch.float64)])


# The symbols of dynamo's float inputs (zf0, ...) whose values this run of the pass baked in; see rewrite().
_float_inputs_to_specialise: list = []


class _Miss(Exception):
    """A candidate that is not provably the same function; the message is the reason."""


def _fused_op():
    return fused_op(_OP_MODULE, "linear_bias_gelu")


def _aten_name(node: object) -> str | None:
    """The name in _ATEN of a ``torch.ops.aten.<name>`` / ``.default`` call node, else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    for name in _ATEN:
        packet = getattr(torch.ops.aten, name)
        if node.target is packet or node.target is packet.default:
            return name
    return None


def _is(node: object, *names: str) -> bool:
    """is_op, and the torch.ops.aten spellings of the ops in _ATEN."""
    return is_op(node, *names) or _aten_name(node) in names


# --------------------------------------------------------------------------------------------------
# The Linear
# --------------------------------------------------------------------------------------------------


def _is_transpose_2d(node: object) -> bool:
    """node is the transpose of a 2-d tensor, its node args[0] (the weight a caller reads from there)."""
    if not isinstance(node, torch.fx.Node) or tensor_meta(node) is None or tensor_meta(node).dim() != 2:
        return False
    if node.op == "call_function" and node.target is getattr:  # w.T / w.mT, as dynamo records them
        return len(node.args) == 2 and node.args[1] in ("T", "mT")
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        # torch.t(input=w): the tensor by keyword. Not read as w's transpose (callers read args[0]; it raised
        # IndexError out of the backend, review s29); as the (K, N) operand it is x @ m, the same function.
        return False
    name = op_name(node)
    if name == "t" or node.target is torch.t:
        return True
    if name == "transpose" or node.target == "transpose":
        return sorted(d % 2 for d in node.args[1:3]) == [0, 1] if len(node.args) == 3 else False
    if name == "permute" or node.target == "permute":
        packed = len(node.args) == 2 and isinstance(node.args[1], (list, tuple))
        dims = node.args[1] if packed else node.args[1:]
        return list(dims) == [1, 0]
    return False


def _bias_add(mm: torch.fx.Node):
    """(add node, b) when mm's only user adds a 1-d (N,) tensor b to it (either side, no alpha), else None."""
    if len(mm.users) != 1:
        return None
    (add,) = mm.users
    b = binary_other(add, "add", mm)
    if b is mm:  # h + h is 2h, not a bias
        return None
    bt, mt = tensor_meta(b), tensor_meta(mm)
    if bt is None or mt is None or bt.dim() != 1 or mt.dim() < 1 \
            or not statically_known_true(bt.shape[0] == mt.shape[-1]):  # no guard on a symbolic N
        return None
    return add, b


def _matmul_linear(node: torch.fx.Node):
    """x @ w.t() [+ b] (or x @ m with m (K, N)) with a 2-d right operand is F.linear(x, w [, b]); a batched
    right operand or a bias of another shape is not."""
    if node.op not in ("call_function", "call_method") or len(node.args) != 2 or node.kwargs:
        return None
    x, m = node.args
    mt = tensor_meta(m)
    if mt is None or mt.dim() != 2 or tensor_meta(x) is None:
        return None
    biased = _bias_add(node)
    out, b = biased if biased is not None else (node, None)
    spelled = "x @ w.t()" if _is_transpose_2d(m) else "x @ w"
    variant = spelled + (" + b" if b is not None else "")
    if _is_transpose_2d(m):
        return variant, x, m.args[0], None, b, out
    return variant, x, None, m, b, out


def _einsum_terms(equation: str):
    """(first term, second term, output term) of a two-operand einsum equation with an explicit output,
    else None."""
    eq = equation.replace(" ", "")
    if eq.count("->") != 1 or eq.count(",") != 1:
        return None
    lhs, out = eq.split("->")
    first, second = lhs.split(",")
    return first, second, out


def _einsum_as_linear(tx: str, tm: str, out: str):
    """For x's term tx and the 2-d operand's term tm: 'nk' or 'kn' when einsum(tx, tm -> out) is x's last
    index contracted with tm's and the output is x's other indices in order, then tm's free one, else None."""
    ellipsis = tx.startswith("...") and out.startswith("...")
    if ellipsis:
        tx, out = tx[3:], out[3:]
    if not (tx.isalpha() and tm.isalpha() and out.isalpha()) or len(tm) != 2 or len(set(tm)) != 2:
        return None
    if len(set(tx)) != len(tx):  # a repeated index is a diagonal
        return None
    k = tx[-1]
    if k not in tm:
        return None
    n = tm.replace(k, "")
    if n in tx or out != tx[:-1] + n:
        return None
    return "nk" if tm == n + k else "kn"


def _einsum_linear(node: torch.fx.Node):
    """torch.einsum('bsk,nk->bsn', x, w) [+ b] is F.linear(x, w [, b]) ('...k,kn->...n' is x @ m with m
    (K, N)); either operand order. Another contraction, a batched or 3-d second operand, a permuted output or
    a repeated index is not a Linear."""
    if node.op != "call_function" or node.kwargs or len(node.args) < 2 or not isinstance(node.args[0], str):
        return None
    ops = node.args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    terms = _einsum_terms(node.args[0])
    if len(ops) != 2 or terms is None:
        return None
    first, second, out = terms
    for (x, tx), (m, tm) in (((ops[0], first), (ops[1], second)), ((ops[1], second), (ops[0], first))):
        layout = _einsum_as_linear(tx, tm, out)
        xt, mt = tensor_meta(x), tensor_meta(m)
        if layout is None or xt is None or mt is None or mt.dim() != 2:
            continue
        if not tx.startswith("...") and xt.dim() != len(tx):
            continue
        biased = _bias_add(node)
        h, b = biased if biased is not None else (node, None)
        variant = f"torch.einsum({node.args[0]!r})" + (" + b" if b is not None else "")
        if layout == "nk":
            return variant, x, m, None, b, h
        return variant, x, None, m, b, h
    return None


def _linear_inputs(node: torch.fx.Node):
    """(variant, x, weight-or-None, transposed-weight-or-None, bias, pre-activation) of a Linear-like node,
    else None. The pre-activation is the node whose value the GELU must take: the node itself, the bias add
    after a matmul, or Conv1D's view back to (..., N) after an addmm."""
    if _is(node, "linear"):
        x, w, b = linear_operands(node)
        return "F.linear", x, w, None, b, node
    if _is(node, "matmul", "mm"):
        return _matmul_linear(node)
    if is_op(node, "einsum"):
        return _einsum_linear(node)
    if _is(node, "addmm"):
        return _addmm_linear(node)
    return None


def _addmm_linear(node: torch.fx.Node):
    """``torch.addmm(b, x, m)`` and its Tensor-method spelling ``b.addmm(x, m)`` (dynamo records
    ``torch.Tensor.addmm(b, x, m)`` so too; self is args[0] either way, mat1 and mat2 after it), with default
    beta and alpha (keyword-only in both). Four or five positional arguments, or a positional number, are
    the deprecated overloads ``torch.addmm(beta, b, [alpha,] x, m)`` / ``b.addmm(beta, [alpha,] x, m)``,
    which scale and put the operands elsewhere: refused (reported), like alpha/beta by keyword."""
    if node.op not in ("call_function", "call_method") or node.op == "call_method" and not node.args:
        return None
    if len(node.args) > 3 or any(not isinstance(a, torch.fx.Node) for a in node.args):
        raise _Miss("addmm in its deprecated overload with alpha/beta given by position; not read, not fused")
    if arg(node, 3, "beta", 1) != 1 or arg(node, 4, "alpha", 1) != 1:
        raise _Miss("addmm has alpha/beta other than 1")
    method = node.op == "call_method"
    b = node.args[0] if method else arg(node, 0, "input", node.kwargs.get("self"))
    x, m = arg(node, 1, "mat1"), arg(node, 2, "mat2")
    bt = tensor_meta(b)
    if bt is None or bt.dim() != 1:
        raise _Miss("addmm's bias is not a 1-d (N,) tensor")
    out = _view_after(node) or node
    spelled = "b.addmm(x, " if method else "torch.addmm(b, x, "
    if _is_transpose_2d(m):
        return f"{spelled}w.t())", x, m.args[0], None, b, out
    return f"{spelled}w) (Conv1D)", x, None, m, b, out


# --------------------------------------------------------------------------------------------------
# The GELU after it
# --------------------------------------------------------------------------------------------------


def _descendants(h: torch.fx.Node, limit: int) -> list[torch.fx.Node]:
    """The first `limit` nodes after h in graph order that depend on h. In graph order, not by following
    users: a depth-first walk went down the rest of the model along the GELU's last user before it came
    back for the cubic term, and missed the GELU of every block but the last few."""
    found, reached = [], {h}
    node = h.next
    while node.op != "root" and len(found) < limit:
        if any(a in reached for a in node.all_input_nodes):
            reached.add(node)
            found.append(node)
        node = node.next
    return found


def _symbolic_constant(node: torch.fx.Node) -> float | None:
    """The value (for this example) of a node computing a Python float from dynamo's float inputs alone, else
    None. dynamic=True makes float globals and module float attributes graph inputs: transformers' NewGELU,
    ``math.sqrt(2.0 / math.pi)``, then computes its constant in the graph from math.pi. A size (SymInt) or
    a tensor is never such a constant."""
    v = val(node)
    if float_input_symbols(v) is None or not is_number(v.node.hint):
        return None
    return float(v.node.hint)


def _ancestors_within(end: torch.fx.Node, h: torch.fx.Node, allowed: set[torch.fx.Node],
                      constants: dict[torch.fx.Node, float]):
    """The nodes end is computed by from h within allowed, else None. A float computed from float inputs
    alone (_symbolic_constant) is a leaf, put in constants with its value."""
    region, stack = set(), [end]
    while stack:
        n = stack.pop()
        if n is h or n in region or n in constants:
            continue
        if n not in allowed:
            c = _symbolic_constant(n)
            if c is None:
                return None
            constants[n] = c
            continue
        region.add(n)
        stack.extend(n.all_input_nodes)
    return region


def _evaluate(region: set[torch.fx.Node], h: torch.fx.Node, end: torch.fx.Node, x: torch.Tensor,
              constants: dict[torch.fx.Node, float] | None = None):
    """The region as a function of h, run in fp64 on x (None if it is not pure pointwise math); the nodes in
    constants read as those numbers."""
    values = {h: x, **(constants or {})}
    for n in sorted(region, key={m: i for i, m in enumerate(h.graph.nodes)}.get):
        if op_name(n) not in _POINTWISE or n.op not in ("call_function", "call_method"):
            return None

        def lookup(a):
            return values[a]

        args = torch.fx.node.map_arg(n.args, lookup)
        kwargs = torch.fx.node.map_arg(n.kwargs, lookup)
        flat = [a for a in (*args, *kwargs.values()) if not isinstance(a, torch.Tensor)]
        if not all(is_number(a) for a in flat):
            return None
        fn = n.target if n.op == "call_function" else getattr(torch.Tensor, n.target)
        values[n] = fn(*args, **kwargs)
    return values[end]


def _unsampled_pole(region: set[torch.fx.Node], h: torch.fx.Node, constants: dict[torch.fx.Node, float]):
    """Why the region may differ from the GELU between the points of _GRID where it equals it, else None: it
    divides by a value computed from h, or raises one to a negative or fractional power, or raises a number to
    a power computed from h. Such a term can hide a pole or a spike between samples: ``1e-13 / (h - 0.0045)``
    adds less than 1e-9 at every point of _GRID and is infinite at h = 0.0045, where a Linear's output lands
    (a zero input row with that bias); ``1e20 ** (-1e10 * (h - c) ** 2)`` is 0 at every sample and 1 at c.
    A fractional power (``1e-20 * (h * h) ** 0.1``) is below the tolerance at every sample, and its gradient
    is infinite at 0 (eager's gradients are NaN at h = 0, a zero row through a bias-free Linear), which the
    GELU's is not. Without them the region is polynomials in h under one tanh, erf or erfc, which samples
    this dense pin down; and no GELU spelling divides by h, takes a root of it or puts it in an exponent."""

    def from_h(a):
        return a is h or a in region

    for n in region:
        if op_name(n) == "div" and from_h(arg(n, 1, "other")):
            return f"{n.name} divides by a value computed from the pre-activation"
        if op_name(n) == "pow":
            base, exponent = arg(n, 0, "input"), arg(n, 1, "exponent")
            if from_h(exponent):
                return f"{n.name} raises to a power computed from the pre-activation"
            exponent = constants.get(exponent, exponent)
            if from_h(base) and (not is_number(exponent) or exponent < 0 or not float(exponent).is_integer()):
                return f"{n.name} raises a value computed from the pre-activation to the power {exponent}"
    return None


def _match_written_out(h: torch.fx.Node):
    """(approximate, end, region, constants) for GELU written out on h, else None. constants: the symbolic
    floats it reads (_symbolic_constant), with their values, which a rewrite bakes in. _Miss when a region
    equals a GELU on the grid but may not between its points (_unsampled_pole)."""
    candidates = _descendants(h, _MAX_WRITTEN_OUT)
    allowed = set(candidates)
    with torch.no_grad():
        ref = {a: torch.nn.functional.gelu(_GRID, approximate=a) for a in ("none", "tanh")}
    doubt = None
    for end in candidates:
        constants: dict[torch.fx.Node, float] = {}
        region = _ancestors_within(end, h, allowed, constants)
        if region is None or sum(op_name(n) in _TRANSCENDENTAL for n in region) != 1:
            continue
        if any(u not in region for n in region - {end} for u in n.users):
            continue  # an intermediate feeds something else; h's other users are reported by the caller
        try:
            y = _evaluate(region, h, end, _GRID, constants)
        except Exception:  # noqa: BLE001 - not evaluable: not a GELU we recognise
            y = None
        if not isinstance(y, torch.Tensor) or y.shape != _GRID.shape:
            continue
        for approximate, r in ref.items():
            if bool(((y - r).abs() <= 1e-9 * r.abs().clamp_min(1.0)).all()):
                if not _same_in_dtype(region, h, end, approximate, constants):
                    break
                pole = _unsampled_pole(region, h, constants)
                if pole is not None:
                    kind = "tanh" if approximate == "tanh" else "erf"
                    doubt = doubt or (f"GELU written out ({kind}) where sampled, but {pole}: not provably "
                                      "the GELU between the samples; not fused")
                    break
                return approximate, end, region, constants
    if doubt is not None:
        raise _Miss(doubt)
    return None


def _same_in_dtype(region: set[torch.fx.Node], h: torch.fx.Node, end: torch.fx.Node,
                   approximate: str, constants: dict[torch.fx.Node, float] | None = None) -> bool:
    """The region run in h's own dtype is the GELU to within rounding: a constant that under- or overflows
    there (``h * 1e-50 * 1e50`` in fp32, ``h * 1e5 / 1e5`` in fp16) is another function (0, inf, nan) that
    fp64 does not show. In an fp64 graph too: the grid's 1e-9 is far looser than fp64's rounding, and
    BLOOM's ``tanh(0.79788456 * x * (1 + 0.044715 * x * x))`` (sqrt(2 / pi) to 8 digits) is a GELU in fp32
    but differs from it by 1e-10 in fp64, a million fp64 rounding steps."""
    ht = tensor_meta(h)
    if ht is None or not ht.is_floating_point():
        return True
    xs = _GRID.to(ht.dtype)
    xs = xs[xs.isfinite()]
    try:
        with torch.no_grad():
            y = _evaluate(region, h, end, xs, constants)
    except Exception:  # noqa: BLE001 - not evaluable in that dtype: not provably the same function
        return False
    if not isinstance(y, torch.Tensor) or y.shape != xs.shape:
        return False
    x = xs.double()
    r = torch.nn.functional.gelu(x, approximate=approximate)
    tol = 64 * torch.finfo(ht.dtype).eps * x.abs().clamp_min(1.0)
    return bool(((y.double() - r).abs() <= tol).all())


def _gelu_after(h: torch.fx.Node):
    """(variant, approximate, end, region, constants) of the GELU applied to h, else None."""
    for u in h.users:
        if _is(u, "gelu"):
            approximate = arg(u, 1, "approximate", "none")
            if approximate not in ("none", "tanh"):
                raise _Miss(f"F.gelu approximate={approximate!r} is not 'none' or 'tanh'")
            return "F.gelu" + ("(tanh)" if approximate == "tanh" else ""), approximate, u, {u}, {}
    found = _match_written_out(h)
    if found is None:
        return None
    approximate, end, region, constants = found
    variant = f"GELU written out ({'tanh' if approximate == 'tanh' else 'erf'})"
    return variant, approximate, end, region, constants


def _view_after(h: torch.fx.Node) -> torch.fx.Node | None:
    """Conv1D's `addmm(...).view(*size_out)`: the single view/reshape user keeping the last dim."""
    if len(h.users) != 1:
        return None
    (v,) = h.users
    if op_name(v) not in ("view", "reshape") and v.target not in ("view", "reshape"):
        return None
    hv, vv = tensor_meta(h), tensor_meta(v)
    # (a view to 0-d, ``addmm(..).view(())`` of a (1, 1) result, has no last dim: read as one, it raised an
    # IndexError out of the backend, failing the compile)
    if hv is None or vv is None or vv.dim() == 0 or hv.dim() == 0 or vv.shape[-1] != hv.shape[-1]:
        return None
    return v


def _is_cast(node: torch.fx.Node, source: torch.fx.Node, dtype: torch.dtype) -> bool:
    """node is ``source.float()`` / ``.to(dtype)`` / ``.type(dtype)`` / ``.half()`` / ``.bfloat16()``, a cast
    to dtype that keeps the shape and the device (``.to("cuda")`` moves the tensor: not a candidate)."""
    if op_name(node) not in _CASTS or not node.args or node.args[0] is not source:
        return False
    out, inp = tensor_meta(node), tensor_meta(source)
    return out is not None and inp is not None and out.dtype == dtype and out.device == inp.device and \
        out.dim() == inp.dim() and all(statically_known_true(a == b) for a, b in zip(out.shape, inp.shape,
                                                                                     strict=True))


def _dtype_references(h: torch.fx.Node) -> list[torch.fx.Node]:
    """h's users that read only its dtype (and device): ``t.type_as(h)`` or ``t.to(h)`` of another tensor t
    (fairseq's ``utils.gelu``, ``F.gelu(x.float()).type_as(x)``, casts the GELU back by naming the
    pre-activation; ``.to(x)`` is that cast spelled with Tensor.to's tensor overload). ``.to(h.dtype)`` and
    ``.to(dtype=h.dtype)`` do not read h: dynamo records them with the dtype itself (_is_cast)."""
    return [u for u in h.users if op_name(u) in ("type_as", "to") and len(u.args) == 2 and not u.kwargs
            and u.args[1] is h and u.args[0] is not h]


def _upcast_after(h: torch.fx.Node) -> torch.fx.Node | None:
    """The cast to fp32 that is h's only user (``F.gelu(lin(x).float())``), besides users reading only its
    dtype (_dtype_references), when h is fp16, bf16 or fp32; else None. Exact: every fp16/bf16 value is an
    fp32 one (and fp32 -> fp32 is the identity)."""
    ht = tensor_meta(h)
    users = [u for u in h.users if u not in _dtype_references(h)]
    if len(users) != 1 or ht is None or ht.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    (up,) = users
    return up if _is_cast(up, h, torch.float32) else None


def _cast_back_by_reference(variant: str, h: torch.fx.Node, end: torch.fx.Node,
                            region: set[torch.fx.Node]) -> tuple[str, torch.fx.Node, set[torch.fx.Node]]:
    """(variant, end, region) taking in the ``gelu.type_as(h)`` / ``gelu.to(h)`` that reads h for its dtype
    (fairseq), when h has one: it must be the cast that ends the GELU (_through_upcast took it as end for
    fp16/bf16 h cast up; for fp32 h, or a GELU computed in h's dtype, ``F.gelu(h).to(h)``, it is the identity
    after the GELU, its only user: the same dtype, on h's device), else _Miss: h is read elsewhere."""
    refs = _dtype_references(h)
    if refs in ([], [end]):
        return variant, end, region
    ref, metas = refs[0], (tensor_meta(refs[0]), tensor_meta(end))
    if len(refs) == 1 and ref.args[0] is end and len(end.users) == 1 and None not in metas and \
            metas[0].dtype == metas[1].dtype and metas[0].device == metas[1].device:
        return f"{variant} (.{op_name(ref)} the pre-activation)", ref, region | {end}
    raise _Miss(f"{variant}: the linear output also feeds {ref.name}, so its pre-activation is needed; "
                "not fused")


def _through_upcast(variant: str, h: torch.fx.Node, up: torch.fx.Node, end: torch.fx.Node,
                    region: set[torch.fx.Node]) -> tuple[str, torch.fx.Node, set[torch.fx.Node]]:
    """(variant, end, region) for a GELU of h cast up to fp32 (up); _Miss when that is not the op's function.

    The op computes the GELU of the pre-activation in fp32 (cuBLASLt's epilogue, the Triton passes and
    ATen's CPU and CUDA GELU all take fp16/bf16 inputs to fp32 first, as does its backward) and rounds it
    to the Linear's dtype once: round(gelu32(h)). From an fp16/bf16 h, eager's ``F.gelu(h.float())`` is
    gelu32(h) unrounded, so only ``F.gelu(h.float()).to(h.dtype)`` (``.to(x.dtype)``) is that function,
    backward too (the cast's backward rounds the GELU's fp32 input gradient to h's dtype, where the op
    computes it in fp32 and rounds it once). Returning round(gelu32(h)) cast up for an fp32 GELU would drop
    eager's fp32 precision: left alone. An fp32 h cast to fp32 is h itself."""
    dtype = tensor_meta(h).dtype
    if dtype == torch.float32:
        return variant, end, region
    name = str(dtype).removeprefix("torch.")
    downs = [u for u in end.users if _is_cast(u, end, dtype)]
    other = [u for u in end.users if op_name(u) in _CASTS and getattr(tensor_meta(u), "dtype", dtype) not in
             (dtype, torch.float32)]
    if len(end.users) == 1 and other:  # ``.to(t)``, t of a third dtype: eager rounds the fp32 GELU to that
        cast = str(tensor_meta(other[0]).dtype).removeprefix("torch.")
        raise _Miss(f"{variant}: the GELU of the {name} pre-activation cast up to fp32 is cast to {cast} (by "
                    f"{other[0].name}), not back to {name}: the fused op rounds it to {name}; not fused")
    if len(end.users) != 1 or not downs:
        users = ", ".join(u.name for u in end.users) or "nothing"
        raise _Miss(f"{variant}: the GELU of the {name} pre-activation cast up to fp32 is used in fp32 (by "
                    f"{users}): the fused op rounds it to {name}; not fused")
    return f"{variant} (in fp32, cast back to {name})", downs[0], region | {end}


# --------------------------------------------------------------------------------------------------
# Rewrite
# --------------------------------------------------------------------------------------------------


def _slower_than_unfused(*inputs) -> bool:
    """A CUDA graph that will need the backward, with the switch for fusing those off (config.py)."""
    metas = [tensor_meta(t) for t in inputs if t is not None]
    on_cuda = any(m is not None and m.device.type == "cuda" for m in metas)
    needs_backward = torch.is_grad_enabled() and any(m is not None and m.requires_grad for m in metas)
    return on_cuda and needs_backward and not flash_config.dense_training_on_cuda


def _added_biases(h: torch.fx.Node, has_bias: bool):
    """The (add, b) of each (N,) tensor added to the Linear's output before the GELU, in order: the bias of a
    bias-free Linear (``F.linear(x, w) + b``), a second bias on a biased one (``lin(x) + b2``), and so on."""
    added = []
    while (biased := _bias_add(h)) is not None:
        added.append(biased)
        h = biased[0]
    names = [f"b{i + 1}" if i else "b" for i in range(int(has_bias), int(has_bias) + len(added))]
    return added, "".join(f" + {name}" for name in names)


def _rewrite_one(graph: torch.fx.Graph, fn, linear: torch.fx.Node) -> bool:
    found = _linear_inputs(linear)
    if found is None:
        return False
    variant, x, weight, mat2, bias, h = found
    view = h if _is(linear, "addmm") and h is not linear else None
    added, spelled = _added_biases(h, bias is not None)
    if added:
        h = added[-1][0]
    up = _upcast_after(h)
    try:
        gelu = _gelu_after(up if up is not None else h)
    except _Miss as miss:  # the GELU's own reason, after the Linear it follows
        raise _Miss(f"{variant}{spelled} + {miss}") from None
    if gelu is None:
        return False
    gelu_variant, approximate, end, region, constants = gelu
    variant = f"{variant}{spelled} + {gelu_variant}"
    if up is not None:
        region = region | {up}
        variant, end, region = _through_upcast(variant, h, up, end, region)
    variant, end, region = _cast_back_by_reference(variant, h, end, region)
    into = out_writer((linear, *region))
    if into is not None:  # torch.addmm(.., out=buf), torch._C._nn.gelu(h, out=buf): buf is written too
        raise _Miss(f"{variant}: {into.name} also writes its result into out=, which the fused op would "
                    "not; not fused")
    outside = [u for n in (h, *filter(None, [up])) for u in n.users if u not in region and u is not end]
    if outside:
        raise _Miss(f"{variant}: the linear output also feeds {outside[0].name}, so its pre-activation "
                    "is needed; not fused")
    crossing = state_crossing([linear, h, end, *region, *(a for a, _ in added)])
    if crossing:
        raise _Miss(f"{variant}: {crossing}")
    # Autocast: the Linear (F.linear, addmm, a matmul) computes in another dtype than its operands, which it
    # casts, its own bias included (eager refuses mixed dtypes otherwise). A bias added after it
    # (x @ w.t() + b, lin(x) + b2) is not cast: an fp32 one promotes the Linear's output to fp32, and the GELU
    # runs in fp32.
    compute = getattr(tensor_meta(linear), "dtype", None)

    def off_dtype(nodes):  # those whose dtype is known and is not the Linear's compute dtype
        if compute is None:
            return []
        return [n for n in nodes if getattr(tensor_meta(n), "dtype", compute) != compute]

    own_bias = bias if bias is not None and bias in linear.all_input_nodes else None
    autocast = off_dtype(n for n in (x, weight, mat2, own_bias) if n is not None)
    if autocast:
        variant = f"{variant} (autocast to {str(compute).removeprefix('torch.')})"
        after = [bias] if own_bias is None and bias is not None else []  # x @ w.t() + b: b is added after
        promoted = off_dtype(after + [b for _, b in added])
        if promoted:
            raise _Miss(f"{variant}: the bias {promoted[0].name} ({tensor_meta(promoted[0]).dtype}) added to "
                        f"the Linear's {compute} output (autocast) promotes it; not fused")

    adds = [a for a, _ in added]
    written = written_before_end({linear, *filter(None, [view]), *adds, h, *region}, end)
    if written is not None:  # dynamo may read one node before and after the write: no single value
        raise _Miss(f"{variant}: {written[0].name} is written in place by {written[1].name} before the GELU "
                    "ends; not fused")
    kept = linear_operand_writer(x, weight if weight is not None else mat2,
                                 {linear, *filter(None, [view]), *adds, h, *region}, end, copied=autocast)
    if kept is not None:  # (before the GELU ends: written_before_end)
        what, operand, writer = kept
        raise _Miss(f"{variant}: its {what} {operand.name} is written in place by {writer.name} after it: "
                    "the fused op keeps it for its backward, which would then fail where eager's (the other "
                    "operand needs no gradient: the matmul keeps only that one) does not")
    biases = [b for b in (bias, *(b for _, b in added)) if b is not None]
    if _slower_than_unfused(x, weight, mat2, *biases):
        raise _Miss(f"{variant}: a training graph on CUDA, and dense_training_on_cuda is off "
                    "(flash_backend/config.py; set it True or FLASH_BACKEND_DENSE_TRAINING=1 to fuse it)")
    inserted = []
    # Under autocast the Linear casts its floating operands to its compute dtype (eager's weight cache holds
    # the same values); the op, which autocast does not touch, gets them cast the same way, in the graph, so
    # that autograd takes each cast's gradient back to the operand's own dtype, as eager does.
    cast = {n: insert_call(graph, torch.Tensor.to, (n, compute), like=linear) for n in autocast}
    inserted += cast.values()
    x, mat2 = cast.get(x, x), cast.get(mat2, mat2)
    if weight is not None:
        weight = cast.get(weight, weight)
    biases = [cast.get(b, b) for b in biases]
    if mat2 is not None:
        weight = insert_call(graph, torch.t, (mat2,), like=linear)
        inserted.append(weight)
    bias = biases[0] if biases else None
    for b in biases[1:]:  # linear(x, w, b) + b2 is linear(x, w, b + b2): the docstring says why that is exact
        bias = insert_call(graph, torch.add, (bias, b), like=linear)
        inserted.append(bias)
    args, kwargs = (x, weight, bias), {"approximate": approximate}
    try:
        result = fake_call(fn, args, kwargs)
    except Exception as e:  # noqa: BLE001 - the op's own input checks say what it cannot take
        erase_unused(graph, inserted)
        reason = str(e).splitlines()[0][:200]
        raise _Miss(f"{variant}: the fused op does not take these inputs: {reason}") from None
    want = tensor_meta(end)
    shaped = tensor_meta(linear) if view is not None else want  # the op returns the addmm's 2-d shape
    if not isinstance(result, torch.Tensor) or want is None or shaped is None or result.dtype != want.dtype \
            or tuple(result.shape) != tuple(shaped.shape):
        erase_unused(graph, inserted)
        got = (result.dtype, tuple(result.shape)) if isinstance(result, torch.Tensor) else None
        eager = "has no metadata" if want is None or shaped is None else (want.dtype, tuple(shaped.shape))
        raise _Miss(f"{variant}: the fused op would return {got}, eager {eager}")

    fused = insert_call(graph, fn, args, kwargs, like=linear)
    if view is not None:
        fused = insert_call(graph, view.target if view.op == "call_function" else _method(view.target),
                            (fused, *view.args[1:]), dict(view.kwargs), like=view)
    end.replace_all_uses_with(fused)
    for node in constants:  # baked in: dynamo guards on them and retraces with them constant (see rewrite())
        v = val(node)
        float(v)
        _float_inputs_to_specialise.extend(float_input_symbols(v))
    record_rewrite(FAMILY, variant, _OP_NAME, linear)
    operands = linear.all_input_nodes
    erase_unused(graph, region | {end, h, linear, *adds, *filter(None, [view])})
    erase_unused(graph, [n for n in operands if _is_transpose_2d(n)])  # the w.t() the op no longer reads
    return True


def _method(name: str):
    return getattr(torch.Tensor, name)


def rewrite(graph: torch.fx.Graph) -> None:
    fn = _fused_op()
    if fn is None:
        return
    _float_inputs_to_specialise.clear()
    linears = [n for n in graph.nodes if _is(n, "linear", "addmm", "matmul", "mm", "einsum")]
    for node in linears:
        if node.graph is not graph:
            continue
        try:
            _rewrite_one(graph, fn, node)
        except _Miss as miss:
            record_near_miss(FAMILY, "Linear + GELU", str(miss), node)
        except Exception as error:  # noqa: BLE001 - a matcher bug must cost a fusion, never the compile
            record_near_miss(FAMILY, "Linear + GELU", f"internal error {type(error).__name__}: {error}", node)
    if _float_inputs_to_specialise:
        # dynamic=True made a float the GELU reads (math.pi) a graph input and a rewrite baked its value in:
        # restart dynamo's analysis with it a constant, as the norm pass does; the decisions of this run are
        # not counted (fx_passes/_report.py: committed_only).
        # Dynamo throws this graph away on the restart, erasing it last node first, which fails on a node
        # still read by one placed before it: the op calls this pass and those before it inserted after
        # their inputs, ahead of run_passes' final sort (review s32: Phi-1.5 under dynamic=True crashed).
        stable_topological_sort(graph)
        restart_with_specialised_floats(_float_inputs_to_specialise)

