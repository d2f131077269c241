"""In-place writes on freshly computed tensors, made functional before the fusion families run.

Models write a residual sum or a mask in place as often as functionally: ``h = r.clone(); h.add_(x)``,
``h = attn_out; h += residual``, ``scores.masked_fill_(m, -inf)``, ``scores += mask``. Dynamo keeps those
writes in its graph, and a pattern that reads a tensor written in place cannot be merged into one call
(``_match.written_before_end``). When the written tensor was just produced by an op that never returns a
view (so no alias can observe the write) and nothing read it before the write, ``t.add_(x)`` is the same
function as ``t2 = t.add(x)`` with every later reader of t reading t2: that is what this step rewrites.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx import Graph

from fx_passes._match import fake_call, in_place_writers, op_name, tensor_meta

# the in-place method -> its functional name
_IN_PLACE_METHODS = {
    "masked_fill_": "masked_fill", "mul_": "mul", "div_": "div", "add_": "add", "sub_": "sub",
}
# `scores += mask`, `q *= scaling` (fairseq): dynamo records augmented assignment as operator.iadd & co.
IN_PLACE_OPERATORS = {
    operator.iadd: "add", operator.isub: "sub", operator.imul: "mul", operator.itruediv: "div",
}
# ops whose result is always a new tensor, never a view of an input
_FRESH = ("matmul", "bmm", "einsum", "baddbmm", "linear", "mul", "div", "add", "sub", "masked_fill", "where",
          "clone")


# Reads of a tensor's metadata only, by position: ``t.size()`` (0), ``m.expand_as(t)`` / ``m.type_as(t)`` (1).
# A read of t's size or dtype before a write into t sees nothing of the write: XLM's
# ``mask = (mask == 0).view(..).expand_as(scores); scores.masked_fill_(mask, min)`` (review s35 M1), where
# expand_as's result is a view of the mask, never of the scores.
_METADATA_READS = {"size": 0, "dim": 0, "numel": 0, "stride": 0, "expand_as": 1, "type_as": 1}


def _reads_metadata_only(user: torch.fx.Node, base: torch.fx.Node) -> bool:
    pos = _METADATA_READS.get(op_name(user)) if user.op in ("call_method", "call_function") else None
    if pos is None or len(user.args) <= pos or user.args[pos] is not base:
        return False
    others: list[torch.fx.Node] = []
    torch.fx.node.map_arg((user.args[:pos], user.args[pos + 1:], user.kwargs), others.append)
    return base not in others


def _same_dims(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b, strict=True))


def _fresh(node: torch.fx.Node) -> bool:
    """node is a new tensor that nothing but its own readers can see: the result of a _FRESH op (not one
    written into an out= buffer: ``torch.add(a, b, out=buf)`` returns buf), or a view / reshape of such a
    tensor that is its only reader (Megatron's and GPT-NeoX's ``bmm(..).view(..)`` scores, then
    ``masked_fill_`` on the view: the write reaches only memory no other node reads)."""
    if op_name(node) in _FRESH:
        return node.kwargs.get("out") is None
    if op_name(node) in ("view", "reshape") and node.args and isinstance(node.args[0], torch.fx.Node):
        source = node.args[0]
        return len(source.users) == 1 and _fresh(source)
    return False


def functionalize_in_place(graph: Graph) -> None:
    """``t.add_(x)`` / ``t += x`` / ``t.masked_fill_(m, v)`` (and mul, div, sub) -> ``t2 = t.add(x)`` etc.

    Only on a t that a non-view op just produced, or a view of one that nothing else reads (_fresh), and
    that nothing read before the write (a reader placed before it could be a view that sees it); every later
    reader of t reads the functional result instead.
    An in-place op keeps its tensor's dtype and shape where the functional one may promote or broadcast
    (bf16 scores += an fp32 mask): those are left alone. A fresh ``clone`` that only fed the write is
    dropped (``r.clone().add_(x)`` is ``r.add(x)``) when r is contiguous and not written in between.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op == "call_method" and node.target in _IN_PLACE_METHODS:
            name = _IN_PLACE_METHODS[node.target]
        elif node.op == "call_function" and node.target in IN_PLACE_OPERATORS and not node.kwargs:
            name = IN_PLACE_OPERATORS[node.target]
        else:
            continue
        if not isinstance(node.args[0], torch.fx.Node) or tensor_meta(node.args[0]) is None:
            continue
        base = node.args[0]
        if not _fresh(base) or any(order[u] < order[node] for u in base.users
                                   if u is not node and not _reads_metadata_only(u, base)):
            continue
        try:
            result = fake_call(getattr(torch.Tensor, name), node.args, node.kwargs)
        except Exception:  # noqa: BLE001 - not computable on the fake values: leave it
            continue
        before = tensor_meta(base)
        if not isinstance(result, torch.Tensor) or result.dtype != before.dtype or not _same_dims(
            tuple(result.shape), tuple(before.shape)
        ):
            continue
        with graph.inserting_after(node):
            functional = graph.call_method(name, node.args, node.kwargs)
        functional.meta.update(node.meta)
        for user in list(base.users):
            if user is not node and user is not functional and order.get(user, -1) > order[node]:
                user.replace_input_with(base, functional)
        node.replace_all_uses_with(functional)
        graph.erase_node(node)
        _drop_clone(base, functional)
        order = {n: i for i, n in enumerate(graph.nodes)}


def _drop_clone(base: torch.fx.Node, functional: torch.fx.Node) -> None:
    """functional = clone(r).op(..) -> r.op(..) when the clone has no other reader: the same values without
    the copy. Kept when r is written in place before functional reads it (the clone saw the value before
    the write) or when r is not contiguous (the clone's layout could differ from the op's output)."""
    if op_name(base) != "clone" or len(base.users) != 1 or base.kwargs.get("memory_format") not in (
            None, torch.preserve_format) or len(base.args) != 1 or functional.args[0] is not base:
        return
    source = base.args[0]
    t = tensor_meta(source)
    if not isinstance(source, torch.fx.Node) or t is None or not t.is_contiguous():
        return
    order = {n: i for i, n in enumerate(base.graph.nodes)}
    if any(order[base] < order[w] < order[functional] for w in in_place_writers(source)):
        return
    if any(a is base for a in functional.args[1:]) or base in functional.kwargs.values():
        return
    functional.replace_input_with(base, source)
    base.graph.erase_node(base)
