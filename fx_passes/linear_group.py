"""Linear-group family: F.linear calls that read the same input -> one F.linear over their stacked weights.

Why: attention's q, k and v projections (BERT, ViT, Llama; Llama's gate and up projections too) are
separate GEMMs over one input. Stacked, the forward is one GEMM with N = N_q + N_k + N_v (fewer, fuller
waves than three GEMMs of N = 768), and the backward's input gradient is one GEMM contracting over the
stacked N, where separately it is three GEMMs and then an elementwise sum of their (M, K) results with the
residual's gradient, which Inductor cannot fold into any of them. The weight and bias gradients become one
GEMM and one column reduction each, sliced back per projection. The stacking copies only the weights
(BERT-base: 3.5 MB a layer).

What is matched: two or more ``F.linear(x, w_i, b_i)`` (``nn.Linear``) on the same input node x, whose
weights (and biases, all present or all absent) are graph inputs (parameters) of one dtype and device with
the same K. The rewrite is ``torch.split(F.linear(x, cat(w_i), cat(b_i)), [N_i], -1)``: every output
element is the same dot product as before. The outputs become column slices of one (..., sum N_i) tensor,
so they are no longer contiguous: a group is left alone (reported) when one of its outputs has a ``view``
that such a slice cannot take.

Runs after every other family (ORDER 90), so that a Linear another family fuses (Linear + GELU, Linear +
cross-entropy) is never taken from it.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx
import torch.nn.functional as F

from flash_backend import config as flash_config
from fx_passes._match import arg, erase_unused, fake_call, insert_call, insert_getitem, is_op, tensor_meta
from fx_passes._report import record_near_miss, record_rewrite

FAMILY = "linear_group"
ORDER = 90

_OP_NAME = "one F.linear over the stacked weights, split"


class _Miss(Exception):
    """A candidate that is not provably the same function (or not safely rewritable); the message says why."""


def _parts(linear: torch.fx.Node):
    return arg(linear, 0, "input"), arg(linear, 1, "weight"), arg(linear, 2, "bias")


def _is_graph_input(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and node.op in ("placeholder", "get_attr")


def _key(linear: torch.fx.Node):
    """Linears with equal keys can be stacked: graph-input weights of one dtype, device and K, and a bias
    on all or none of them. None when the linear cannot be stacked at all."""
    _, weight, bias = _parts(linear)
    w = tensor_meta(weight)
    if not _is_graph_input(weight) or w is None or w.dim() != 2:
        return None
    if bias is not None and (not _is_graph_input(bias) or tensor_meta(bias) is None):
        return None
    return w.dtype, w.device, w.shape[1], bias is not None


def _check_views(linear: torch.fx.Node, piece: torch.fx.Node) -> None:
    """Each .view of the linear's output must also work on the strided column slice that replaces it."""
    for user in linear.users:
        if user.target not in ("view", torch.Tensor.view) or user.args[0] is not linear:
            continue
        try:
            fake_call(lambda t, *shape: t.view(*shape), (piece, *user.args[1:]), {})
        except Exception:  # noqa: BLE001 - the fake view says it needs the output contiguous
            raise _Miss(f"{user.name} views {linear.name}'s output in a way a column slice of the stacked "
                        "output cannot take") from None


def _rewrite_group(graph: torch.fx.Graph, x: torch.fx.Node, linears: list[torch.fx.Node]) -> None:
    weights = [_parts(n)[1] for n in linears]
    biases = [_parts(n)[2] for n in linears]
    sizes = [tensor_meta(w).shape[0] for w in weights]
    stacked_w = insert_call(graph, torch.cat, (weights,), {"dim": 0}, like=linears[0])
    stacked_b = insert_call(graph, torch.cat, (biases,), {"dim": 0}, like=linears[0]) \
        if biases[0] is not None else None
    out = insert_call(graph, F.linear, (x, stacked_w, stacked_b), like=linears[0])
    split = insert_call(graph, torch.split, (out, sizes), {"dim": -1}, like=linears[0])
    pieces = [insert_getitem(graph, split, i) for i in range(len(linears))]
    try:
        for linear, piece in zip(linears, pieces, strict=True):
            want, got = tensor_meta(linear), tensor_meta(piece)
            if want is None or got is None or (want.dtype, want.shape) != (got.dtype, got.shape):
                raise _Miss(f"the stacked output's slice for {linear.name} would differ in dtype or shape")
            _check_views(linear, piece)
    except _Miss:
        erase_unused(graph, [*pieces, split, out, stacked_w, *([stacked_b] if stacked_b is not None else [])])
        raise
    for linear, piece in zip(linears, pieces, strict=True):
        linear.replace_all_uses_with(piece)
    names = ", ".join(n.name for n in linears)
    record_rewrite(FAMILY, f"{len(linears)} F.linear on one input ({names})", _OP_NAME, linears[0])
    erase_unused(graph, linears)


def _on_cuda_but_off(x: torch.fx.Node) -> bool:
    meta = tensor_meta(x)
    return meta is not None and meta.device.type == "cuda" and not flash_config.group_linears_on_cuda


def rewrite(graph: torch.fx.Graph) -> None:
    by_input: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        x = _parts(node)[0] if is_op(node, "linear") and node.op == "call_function" else None
        if isinstance(x, torch.fx.Node):
            by_input[x].append(node)
    for x, linears in by_input.items():
        groups: dict[object, list[torch.fx.Node]] = defaultdict(list)
        for linear in linears:
            key = _key(linear)
            if key is not None:
                groups[key].append(linear)
        for group in groups.values():
            if len(group) < 2:
                continue
            try:
                if _on_cuda_but_off(x):
                    raise _Miss("on CUDA with flash_backend.config.group_linears_on_cuda off")
                _rewrite_group(graph, x, group)
            except _Miss as miss:
                record_near_miss(FAMILY, f"{len(group)} F.linear on one input", str(miss), group[0])

