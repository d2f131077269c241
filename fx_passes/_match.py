"""Small helpers for matching the Torch IR that dynamo produces.

Dynamo graphs spell one operation many ways: ``a + b`` (operator.add), ``torch.add(a, b)``,
``a.add(b)`` (call_method). The passes match on *canonical names* so that one pattern covers every
spelling; ``op_name`` does that mapping, ``operands`` returns the positional arguments with ``self``
first for methods. Values are read from ``node.meta["example_value"]`` (fake tensors from dynamo).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import numbers
import operator
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.fx
import torch.nn.functional as F

from fx_passes._compat import detect_fake_mode

_FUNCTIONS: dict[object, str] = {
    operator.add: "add", torch.add: "add",
    operator.sub: "sub", torch.sub: "sub", torch.subtract: "sub",
    operator.mul: "mul", torch.mul: "mul", torch.multiply: "mul",
    operator.truediv: "div", torch.div: "div", torch.divide: "div", torch.true_divide: "div",
    operator.pow: "pow", torch.pow: "pow",
    operator.neg: "neg", torch.neg: "neg",
    operator.matmul: "matmul", torch.matmul: "matmul", torch.bmm: "bmm", torch.einsum: "einsum",
    torch.baddbmm: "baddbmm",
    torch.rsqrt: "rsqrt", torch.sqrt: "sqrt", torch.tanh: "tanh", torch.erf: "erf",
    torch.mean: "mean", torch.var: "var", torch.sum: "sum", torch.square: "square",
    torch.where: "where", torch.masked_fill: "masked_fill",
    torch.transpose: "transpose", torch.permute: "permute", torch.reshape: "reshape",
    torch.softmax: "softmax", F.softmax: "softmax",
    F.dropout: "dropout", torch.dropout: "dropout",
    F.layer_norm: "layer_norm", torch.layer_norm: "layer_norm",
    F.linear: "linear", torch._C._nn.linear: "linear", torch.addmm: "addmm",
    F.gelu: "gelu", torch._C._nn.gelu: "gelu",
    F.scaled_dot_product_attention: "sdpa",
}
# torch.special's spellings are separate function objects named "special_erf" etc.: the same functions.
# ndtr (the normal CDF, Phi) has no torch / Tensor spelling: ``h * torch.special.ndtr(h)`` is the erf GELU.
_FUNCTIONS.update({torch.special.erf: "erf", torch.special.erfc: "erfc", torch.special.ndtr: "ndtr",
                   torch.special.log_softmax: "log_softmax"})
if hasattr(F, "rms_norm"):
    _FUNCTIONS[F.rms_norm] = "rms_norm"
if hasattr(torch, "rms_norm"):
    _FUNCTIONS[torch.rms_norm] = "rms_norm"

_METHOD_ALIASES = {
    "__add__": "add", "__radd__": "add", "__sub__": "sub", "__mul__": "mul", "__rmul__": "mul",
    "__truediv__": "div", "true_divide": "div", "divide": "div", "multiply": "mul", "subtract": "sub",
    "__matmul__": "matmul", "__pow__": "pow",
}


_OPERATOR_NAMES = {operator.getitem: "getitem", operator.invert: "invert", operator.eq: "eq"}


def _own_name(target) -> str | None:
    """A torch function the table does not list goes by its own name (torch.ones -> 'ones')."""
    if target in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[target]
    fn_name = getattr(target, "__name__", None)
    if fn_name and any(getattr(mod, fn_name, None) is target for mod in (torch, F, torch.Tensor)):
        return fn_name
    return None


def op_name(node: object) -> str | None:
    """Canonical name of what node computes ('add', 'layer_norm', 'float', ...), or None."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_function":
        try:
            name = _FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            return None
        return name if name is not None else _own_name(node.target)
    if node.op == "call_method":
        return _METHOD_ALIASES.get(node.target, node.target)
    return None


def is_op(node: object, *names: str) -> bool:
    return op_name(node) in names


def operands(node: torch.fx.Node) -> tuple:
    """Positional arguments, with the tensor a method is called on first."""
    return tuple(node.args)


# The keywords naming the operands of add / sub / mul / div: torch.mul(input=s, other=c); a method's self is
# always its first positional argument (s.mul(other=c)). operator.* takes positional operands only.
_OPERAND_KEYWORDS = ("input", "other")


def binary_operand_pair(node: object) -> tuple | None:
    """(a, b) of a binary arithmetic node (add, sub, mul, div), by position or keyword: ``torch.mul(s,
    other=c)``, ``s.mul(other=c)`` and ``torch.div(input=s, other=c)`` are ``s * c`` and ``s / c``. None when
    there are not exactly two (any other keyword, alpha or rounding_mode, is the caller's to read:
    binary_extra_kwargs)."""
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method") \
            or len(node.args) > 2:
        return None
    if node.op == "call_method" and not node.args:
        return None
    keywords = _OPERAND_KEYWORDS if node.op == "call_function" else ("self", "other")
    values = list(node.args) + [node.kwargs[k] for k in keywords[len(node.args):] if k in node.kwargs]
    return tuple(values) if len(values) == 2 else None


def binary_extra_kwargs(node: torch.fx.Node) -> dict:
    """A binary arithmetic node's keywords other than its operands (alpha, rounding_mode, out)."""
    return {key: value for key, value in node.kwargs.items() if key not in _OPERAND_KEYWORDS}


def out_writer(nodes: Iterable) -> torch.fx.Node | None:
    """The first of nodes that also writes its result into an ``out=`` tensor (``torch.matmul(p, v,
    out=buf)``, ``torch.addmm(b, x, w, out=buf)``): a rewrite that fuses it away leaves buf unwritten, so
    the caller refuses it (review s28)."""
    return next((n for n in nodes if isinstance(n, torch.fx.Node) and n.kwargs.get("out") is not None), None)


def binary_operands(node: object, name: str) -> tuple | None:
    """(lhs, rhs) of a plain binary op named name, by position or keyword (binary_operand_pair), with no
    other keyword set (alpha, rounding_mode, out; one given as None is its default), else None."""
    if not is_op(node, name) or any(v is not None for v in binary_extra_kwargs(node).values()):
        return None
    return binary_operand_pair(node)


def binary_other(node: object, name: str, this: torch.fx.Node):
    """For a commutative binary op on `this` (add, mul), the other operand, else None."""
    pair = binary_operands(node, name)
    if pair is None or not any(a is this for a in pair):
        return None
    return pair[1] if pair[0] is this else pair[0]


# Results that may share memory with their first argument (views, and casts / contiguous that return self
# when there is nothing to do): a write through one is a write to all. Generous on purpose: an alias too
# many costs a fusion, one too few a wrong rewrite.
_ALIASING = frozenset({
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze", "expand",
    "expand_as", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis", "permute", "t", "adjoint",
    "getitem", "narrow", "select", "slice", "as_strided", "unfold", "split", "split_with_sizes", "chunk",
    "tensor_split", "hsplit", "vsplit", "dsplit", "unbind", "diagonal", "detach", "alias", "broadcast_to",
    "ravel", "atleast_1d", "atleast_2d", "atleast_3d", "positive", "conj", "resolve_conj", "resolve_neg",
    "contiguous", "cpu", "cuda",
    "to", "type", "type_as", "float", "half", "bfloat16", "double", "int", "long", "short", "char", "byte",
    "bool", "real", "imag", "view_as_real", "view_as_complex",
})
# Dropout returns its input itself when it drops nothing: in eval (training=False) or with p = 0.
_DROPOUTS = ("dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d")


def _dropout_returns_input(node: torch.fx.Node) -> bool:
    """A dropout call that may return its input itself: p = 0, training off (``F.dropout``'s training,
    ``torch.dropout``'s train), or either not a constant."""
    if op_name(node) not in _DROPOUTS:
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    kwargs = node.kwargs
    training = node.args[2] if len(node.args) > 2 else kwargs.get("training", kwargs.get("train", True))
    return not isinstance(p, (int, float)) or p == 0 or training is not True


# Written into their first argument although not spelled with a trailing underscore.
_WRITERS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.ipow,
            operator.iand, operator.ior, operator.ixor, operator.setitem)
# Augmented assignments called by name (``t.__iadd__(b)``, ``torch.Tensor.__imul__(t, 2)``): dynamo records
# them as such, and a trailing-underscore rule skips dunders (review s27: ``logits.__iadd__(b)`` before a
# loss went unseen and the fused loss read the logits unwritten).
_IN_PLACE_DUNDERS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "lshift", "rshift", "and", "or",
    "xor")) | {"__setitem__"}
# Pure although spelled with a trailing underscore (dynamo records `a & b` as operator.and_).
_PURE_UNDERSCORED = (operator.and_, operator.or_, operator.not_)


def is_in_place(node: object) -> bool:
    """Whether node writes into its first argument: an in-place method or function (``add_``,
    ``masked_fill_``, ``torch.relu_``), an augmented assignment or item assignment, or ``inplace=True``
    (``F.dropout``'s fourth positional argument too)."""
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    if node.op == "call_function" and node.target in _PURE_UNDERSCORED:
        return False
    if node.op == "call_function" and node.target in _WRITERS or node.kwargs.get("inplace") is True:
        return True
    if op_name(node) == "dropout" and len(node.args) > 3 and node.args[3] is True:
        return True
    name = str(op_name(node) or node.target)
    return name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


def _is_alias_of_arg0(node: torch.fx.Node) -> bool:
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.op == "call_function" and node.target is getattr:  # x.T, x.mT, x.real
        return True
    return op_name(node) in _ALIASING or is_in_place(node) or _dropout_returns_input(node)  # x.mul_(2): x


def storage_family(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node], list[torch.fx.Node]]:
    """(base, members, writers) of node's memory: base is node seen up through what it aliases (views, the
    results of in-place calls); members are base and every node that may alias it (views of views, the
    result of a write, which is the tensor written: ``m = torch.ones(S, S).tril_(); m[0] = 0`` writes the
    ones tensor, review s29); writers the nodes that write into a member (in place, item assignment,
    ``out=``). Members and writers in graph order when there are writers."""
    base = node
    while _is_alias_of_arg0(base):
        base = base.args[0]
    members, writers, pending, seen = [], [], [base], set()
    while pending:
        n = pending.pop()
        if n in seen:
            continue
        seen.add(n)
        members.append(n)
        for u in n.users:
            out = u.kwargs.get("out")
            if out is n or isinstance(out, (list, tuple)) and any(o is n for o in out):
                writers.append(u)
                pending.append(u)  # its result is the out= tensor
            elif _is_alias_of_arg0(u) and u.args[0] is n:
                if is_in_place(u):
                    writers.append(u)
                pending.append(u)
    if not writers:
        return base, members, writers
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return base, sorted(members, key=order.__getitem__), sorted(set(writers), key=order.__getitem__)


def in_place_writers(node: torch.fx.Node, allowed: Iterable[torch.fx.Node] = ()) -> list[torch.fx.Node]:
    """The nodes outside allowed that write into node's memory (storage_family's writers, in graph order).
    Where such a write runs decides what each reader sees, so a pass that moves or merges the readers must
    mind them."""
    allowed = set(allowed)
    return [w for w in storage_family(node)[2] if w not in allowed]


def written_before_end(pattern: Iterable[torch.fx.Node], end: torch.fx.Node) -> tuple | None:
    """(node, writer) for a tensor the pattern reads that is written in place outside it before its last
    node (end), else None. The passes put the fused op right after its inputs: a write that ran between
    an input and the pattern would then come after the op, which would read the value before it. Writes
    after end are harmless: the op has read by then, and writes to end itself move with end's readers.
    So are writes that ran before the node read was produced, the write's own result among them (XLM's
    ``h = norm(..); h *= mask`` then ``norm(h + f(h))`` reads ``h *= mask``'s result, the written value,
    wherever the op runs after it; review s30: that norm was a near miss)."""
    pattern = set(pattern)
    order = {n: i for i, n in enumerate(end.graph.nodes)}
    reads = pattern | {a for n in pattern for a in n.all_input_nodes}
    for node in sorted(reads, key=order.get):
        for writer in in_place_writers(node, pattern):
            if order[node] < order[writer] < order[end]:
                return node, writer
    return None


def arg(node: torch.fx.Node, index: int, name: str, default=None):
    """Argument by position or keyword (positions count self first for methods)."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def linear_operands(node: torch.fx.Node) -> tuple:
    """(x, weight, bias) of an ``F.linear`` call node, by position or keyword; bias None when absent."""
    return arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")


@functools.cache
def _signature(fn: Callable) -> inspect.Signature:
    return inspect.signature(fn)


def bound_arguments(node: torch.fx.Node, fn: Callable) -> dict | None:
    """A call node's arguments bound by name to fn's signature, defaults filled in; None if they do not
    bind (a call the pass cannot read, reported by the caller)."""
    try:
        bound = _signature(fn).bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound.arguments


def fused_op(module: str, name: str) -> Callable | None:
    """The public function `name` of flash_backend's `module`, imported at the first rewrite (the passes do
    not import flash_backend's ops at their own import); None where it is missing."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def val(node: object):
    """The fake tensor (or SymInt, or Python value) a node produces."""
    if isinstance(node, torch.fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def tensor_meta(node: object) -> torch.Tensor | None:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def is_number(x: object) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def only_users(node: torch.fx.Node, allowed: Iterable[torch.fx.Node]) -> bool:
    """True when every user of node is in allowed (an intermediate we may fold away)."""
    allowed = set(allowed)
    return all(u in allowed for u in node.users)


def norm_dim(dim, ndim: int) -> int | None:
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return None
        dim = dim[0]
    if not isinstance(dim, int):
        return None
    return dim + ndim if dim < 0 else dim


def is_last_dim(dim, ndim: int) -> bool:
    return norm_dim(dim, ndim) == ndim - 1


def fake_call(fn: Callable, args: Sequence, kwargs: dict):
    """Run fn on the fake values of its node arguments, to give a new node its example_value."""
    fake_tensors = []

    def to_val(node):
        v = val(node)
        if isinstance(v, torch.Tensor):
            fake_tensors.append(v)
        return v

    fargs, fkwargs = torch.fx.node.map_arg((tuple(args), dict(kwargs)), to_val)
    # The example values carry dynamo's fake mode; the tracing context a backend runs in may hold
    # another one (torch 2.13), and mixing the two fails. Prefer the values' own mode.
    modes = {id(m): m for m in (getattr(t, "fake_mode", None) for t in fake_tensors) if m is not None}
    fake_mode = next(iter(modes.values())) if len(modes) == 1 else detect_fake_mode(fake_tensors)
    if fake_mode is None:
        return None
    with fake_mode:
        return fn(*fargs, **fkwargs)


# Nodes dynamo records for ``with torch.no_grad()`` / ``enable_grad()`` / ``set_grad_enabled`` /
# ``inference_mode`` / ``autocast`` inside a compiled function: global state that holds for every node after
# them, up to the next one. A fused call must run in the state of the nodes it replaces.
_STATE_CHANGES = frozenset({"_set_grad_enabled", "set_grad_enabled", "_enter_autocast", "_exit_autocast",
                            "_enter_inference_mode", "_exit_inference_mode"})


def _changes_state(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", None) in _STATE_CHANGES


def _state_args(node: torch.fx.Node) -> tuple:
    """The constant arguments of a state change (a context node stands for itself)."""
    return tuple(a if isinstance(a, (bool, int, float, str, type(None), torch.dtype)) else id(a)
                 for a in node.args)


def _disables_autocast_already_off(node: torch.fx.Node, contexts: list, autocast_off: frozenset) -> bool:
    """Whether node, an ``_enter_*`` node, is ``torch.autocast(device, enabled=False)`` for a device whose
    autocast is off where it runs: off on entry (autocast_off) and turned on by no context open around it.
    Such a block changes nothing (llm-foundry's LPLayerNorm and OLMo's low-precision LayerNorm wrap every
    F.layer_norm in one; outside autocast their fused residual add + norm is the same function)."""
    if node.target.__name__ != "_enter_autocast" or len(node.args) < 3 or node.args[2] is not False:
        return False
    device = node.args[0]
    # an enclosing context either changed nothing (None) or is another autocast whose args say whether it
    # turned this device's autocast on; an unknown device or argument counts as on
    return device in autocast_off and all(
        c is None or c[0] != "_enter_autocast" or c[1] != device or c[3] is False for _, c in contexts)


def state_regions(graph: torch.fx.Graph) -> dict[torch.fx.Node, tuple[int, int]] | None:
    """For each node, (segment, state): how many grad-mode / autocast changes precede it, and a number for
    the state it runs in (grad mode and the stack of open autocast / inference_mode contexts; nodes with the
    same number run in the same state, e.g. on both sides of a rotary embedding's autocast(enabled=False)
    block). None for a graph without such changes, the common case.

    The grad mode on entry is the one run_passes was called in (dynamo guards on it; it compiles one graph
    per grad mode), so ``_set_grad_enabled(True)`` closing a no_grad block returns to the entry state. So is
    the autocast state, by device (dynamo guards on it too): an ``autocast(enabled=False)`` block where
    autocast is already off is no change of state (_disables_autocast_already_off)."""
    has = getattr(graph, "_flash_has_state_changes", None)
    if has is None:  # the passes never add or remove these nodes: looked for once per graph
        has = graph._flash_has_state_changes = any(_changes_state(n) for n in graph.nodes)
    if not has:
        return None
    grad = getattr(graph, "_flash_entry_grad_enabled", "entry")
    autocast_off = getattr(graph, "_flash_entry_autocast_off", frozenset())
    contexts: list[tuple[torch.fx.Node, tuple | None]] = []
    states: dict[tuple, int] = {}
    regions, segment = {}, 0
    for n in graph.nodes:
        if _changes_state(n):
            segment += 1
            name = n.target.__name__
            if name.endswith("set_grad_enabled"):
                grad = n.args[0] if n.args and isinstance(n.args[0], bool) else ("unknown", n)
            elif name.startswith("_enter_"):
                state = None if _disables_autocast_already_off(n, contexts, autocast_off) else (
                    name, *_state_args(n))
                contexts.append((n, state))
            else:  # _exit_*: closes the context its argument entered
                entered = n.args[0] if n.args else None
                contexts = [c for c in contexts if c[0] is not entered]
        key = (grad, tuple(c[1] for c in contexts if c[1] is not None))
        regions[n] = (segment, states.setdefault(key, len(states)))
    return regions


def records_no_grad(graph: torch.fx.Graph) -> bool:
    """The graph runs with grad disabled throughout (entered under no_grad, no grad-mode change inside):
    nothing it computes is saved for a backward."""
    return getattr(graph, "_flash_entry_grad_enabled", True) is False and state_regions(graph) is None


def records_grad(result: object) -> bool:
    """Whether autograd may record the computation of result, a pattern's last node: the graph does not run
    with grad disabled throughout, and result's example value (dynamo's, which knows the grad mode and
    which inputs need a gradient) requires grad or is unknown. Where it does not, neither eager's ops nor a
    fused op keep anything for a backward, and an in-place write after them is harmless."""
    if isinstance(result, torch.fx.Node) and records_no_grad(result.graph):
        return False
    return _needs_grad(result)


def _needs_grad(node: object) -> bool:
    meta = tensor_meta(node) if isinstance(node, torch.fx.Node) else None
    return meta is None or bool(meta.requires_grad)  # unknown: as if it did


def linear_operand_writer(x, weight, pattern: Iterable[torch.fx.Node], result: torch.fx.Node,
                          copied: Iterable[torch.fx.Node] = (),
                          ) -> tuple[str, torch.fx.Node, torch.fx.Node] | None:
    """(what, operand, writer) for an operand of a Linear, x or its weight (``x @ w.t()``: w or w.t()),
    that a fused op keeping both for its backward keeps where eager's matmul does not, and a node outside
    pattern that writes it in place; else None. Eager's matmul keeps an operand only for the other's
    gradient: x when the weight needs one, the weight when x does. A fused op that keeps x and the weight
    whenever anything needs a gradient fails its backward ("modified by an inplace operation") after a write
    that eager trains through (review s29: a frozen LM head or MLP, LoRA, ``h.add_(..)`` after it; a trained
    head or first layer on an input that needs no gradient, its weight updated in the graph afterwards,
    ``with torch.no_grad(): w.mul_(..)``). Nothing is kept where result is not recorded (records_grad).
    copied: operands the op gets as a copy (autocast's cast), which a write to them does not reach."""
    if not records_grad(result):
        return None
    copied, pattern = set(copied), set(pattern)
    order = {n: i for i, n in enumerate(result.graph.nodes)}
    for what, operand, other in (("input", x, weight), ("weight", weight, x)):
        if not isinstance(operand, torch.fx.Node) or operand in copied or _needs_grad(other):
            continue
        # (a write before result is the callers' written_before_end's)
        writers = [w for w in in_place_writers(operand, pattern) if order[w] > order[result]]
        if writers:
            return what, operand, writers[0]
    return None


def state_crossing(nodes: Iterable[torch.fx.Node]) -> str | None:
    """Why a fused call cannot replace `nodes` (they do not all run in one grad-mode / autocast state), or
    None."""
    nodes = [n for n in nodes if isinstance(n, torch.fx.Node)]
    regions = state_regions(nodes[0].graph) if nodes else None
    if regions is None or len({regions[n][1] for n in nodes}) <= 1:
        return None
    return ("a torch.no_grad() / enable_grad() / set_grad_enabled / autocast region begins or ends inside "
            "the pattern: one fused call would run it all in one state")


def insert_call(graph: torch.fx.Graph, fn: Callable, args: Sequence, kwargs: dict | None = None,
                *, after: Sequence[torch.fx.Node] = (), like: torch.fx.Node | None = None) -> torch.fx.Node:
    """Insert call_function(fn) right after the last of its input nodes, with example_value meta.

    Placing it after its inputs (rather than at the matched root) keeps it ahead of every user of
    the outputs it replaces; callers run stable_topological_sort when they are done.
    """
    kwargs = kwargs or {}
    inputs: list[torch.fx.Node] = list(after)
    torch.fx.node.map_arg((tuple(args), kwargs), lambda n: inputs.append(n))
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(inputs, key=lambda n: order[n]) if inputs else None
    if last is None or last.op == "placeholder":
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        last = placeholders[-1] if placeholders else None
    regions = state_regions(graph) if like is not None else None
    if regions is not None and last is not None and regions[last][1] != regions[like][1]:
        # the last input was computed in another grad-mode / autocast state (before a no_grad block, or
        # inside one that closed before like): the call goes after the first state change after it that
        # returns to like's state
        back = [n for n in graph.nodes if order[n] > order[last] and regions[n][1] == regions[like][1]]
        if not back:
            raise ValueError(f"no point after {last.name} runs in {like.name}'s grad-mode / autocast state")
        last = back[0]
    anchor_ctx = graph.inserting_after(last) if last is not None else graph.inserting_before()
    with anchor_ctx:
        node = graph.call_function(fn, tuple(args), kwargs)
    if like is not None:
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    try:
        node.meta["example_value"] = fake_call(fn, args, kwargs)
    except Exception:  # noqa: BLE001 - meta is a convenience for later passes, never required
        pass
    return node


def insert_getitem(graph: torch.fx.Graph, node: torch.fx.Node, index: int) -> torch.fx.Node:
    with graph.inserting_after(node):
        item = graph.call_function(operator.getitem, (node, index))
    value = node.meta.get("example_value")
    if isinstance(value, (tuple, list)):
        item.meta["example_value"] = value[index]
    for key in ("stack_trace",):
        if key in node.meta:
            item.meta[key] = node.meta[key]
    return item


# Random ops (by name): one nobody reads still draws from the generator, and erasing it would shift what
# every later random op draws. Matched as substrings (rand_like, randint, native_dropout, ...).
_RANDOM_NAMES = ("rand", "bernoulli", "normal", "multinomial", "poisson", "dropout", "exponential", "cauchy",
                 "geometric", "uniform", "random")
# Tensor methods that act on something besides their result although spelled without a trailing underscore.
_ACTING_METHODS = frozenset({"retain_grad", "register_hook", "register_post_accumulate_grad_hook",
                             "backward", "record_stream", "share_memory_"})


def _pure(node: torch.fx.Node) -> bool:
    """node only computes a tensor: a torch function or Tensor method (a user function, a custom op or a
    higher-order op may do anything), not writing in place or into ``out=``, not random, not changing the
    grad mode or autocast state. Narrow on purpose: a node taken for pure wrongly is erased."""
    if node.op not in ("call_function", "call_method") or not isinstance(val(node), torch.Tensor):
        return False
    if is_in_place(node) or node.kwargs.get("out") is not None or _changes_state(node):
        return False
    if node.op == "call_method":
        if not hasattr(torch.Tensor, node.target) or node.target in _ACTING_METHODS:
            return False
    elif op_name(node) is None or node.is_impure():
        return False
    name = str(op_name(node) or node.target)
    return not any(r in name for r in _RANDOM_NAMES)


def erase_dead_code(graph: torch.fx.Graph) -> None:
    """Erase the pure nodes (_pure) whose result nobody reads, and those only they read.

    Dynamo keeps a value a module computes and drops (openai/whisper's ``qk.detach()``, returned by
    qkv_attention and dropped by its block) as a node without users; read as another user of an
    intermediate, it blocked the fusion of the pattern around it (review s32, A2). Such a node reads
    nothing for anyone, and Inductor erases it anyway. In-place, random and other acting nodes stay, and
    count as users."""
    for node in reversed(list(graph.nodes)):
        if not node.users and _pure(node):
            graph.erase_node(node)


def erase_unused(graph: torch.fx.Graph, nodes: Iterable[torch.fx.Node]) -> None:
    """Erase the matched nodes that no longer have users (latest first)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(nodes), key=lambda n: order.get(n, -1), reverse=True):
        if node.graph is graph and not node.users and node.op not in ("placeholder", "output"):
            graph.erase_node(node)
