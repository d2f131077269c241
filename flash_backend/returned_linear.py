"""Returned logits: the gradient of a Linear output that a graph returns is taken outside the graph.

Why: a model that computes its loss also returns its logits (every transformers model: ``out.loss`` and
``out.logits``), and the training step backpropagates the loss only. AOTAutograd compiles the graph as
one autograd Function, and autograd hands an unused output's gradient to it as zeros of the output's shape:
BERT-base's (16384, 30522) bf16 logits cost a 1 GB fill and a 1 GB read in the compiled backward every
step (~0.6 ms on an H200, in Inductor's graph and in ours).

What: before Inductor compiles a graph (training, grad mode on), each output that is a Linear's
``F.linear(x, weight, bias)`` whose value the graph also uses (the loss reads it) and that is wider than its
input (out_features > in_features: logits, not a projection) is returned detached, with x appended to the
outputs. Outside the compiled function, ``_ReturnedLinear`` gives the returned tensor its gradient edge
back: its backward is the Linear's (grad @ weight into x, gradᵀ x into weight, the row
sum into bias). So

- ``out.loss.backward()``: autograd never calls it, and the compiled backward receives zeros of x's shape
  (BERT-base: 25 MB) instead of the logits' (1 GB);
- a backward through the logits too (``(loss + logits.sum()).backward()``) gets the same gradients as
  before: the logits' gradient reaches x through the compiled backward and weight and bias directly, and
  autograd sums it with the loss's.

weight and bias must be inputs of the graph (dynamo makes a module's parameters inputs): the wrapper takes
them from the call's arguments. x may be anything. Nothing else changes: the in-graph uses of the Linear's
output are untouched, and the outputs the caller receives are the graph's own, in the same order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fx_passes._match import in_place_writers, is_op, linear_operands, tensor_meta
from fx_passes._report import record_rewrite

log = logging.getLogger("flash_backend")

FAMILY = "returned_linear"


@dataclass(frozen=True)
class ReturnedLinear:
    """Output `index` of the graph is returned detached, the Linear's input x as output `x_output`; its
    weight and bias are the graph's inputs number `weight_input` and `bias_input` (None: no bias)."""

    index: int
    x_output: int
    weight_input: int
    bias_input: int | None


class _ReturnedLinear(torch.autograd.Function):
    """Identity on the detached output y = F.linear(x, weight, bias), with the Linear's backward."""

    @staticmethod
    def forward(ctx, y, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        # A new tensor on y's memory, not a view of it: the caller may write it in place as the graph's own
        # output (a view made inside a Function may not be), and unlike mark_dirty(y) this bumps no version
        # counter that the compiled backward checks when it saved y itself (a classifier's logits).
        return y.detach()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_x = grad @ weight.to(grad.dtype)
        if ctx.needs_input_grad[2]:
            grad_weight = (rows.t() @ x.reshape(-1, x.shape[-1]).to(grad.dtype)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = rows.sum(0, dtype=torch.float32).to(grad.dtype)
        return None, grad_x, grad_weight, grad_bias


def _is_graph_input(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "placeholder"


def _why_not(node: torch.fx.Node, output: torch.fx.Node, outputs: list) -> str | None:
    """Why the returned node is not split (None: it is). Only for a node that is an F.linear."""
    x, weight, bias = linear_operands(node)
    y, w = tensor_meta(node), tensor_meta(weight)
    if y is None or w is None or tensor_meta(x) is None:
        return "no tensor metadata"
    if not y.requires_grad or not y.is_floating_point():
        return "it does not require grad"
    if not _is_graph_input(weight) or (bias is not None and not _is_graph_input(bias)):
        return "its weight or bias is not an input of the graph"
    if w.dim() != 2 or not statically_known_true(w.shape[0] > w.shape[1]):
        return "it is not wider than its input (out_features <= in_features)"
    if sum(1 for o in outputs if o is node) != 1:
        return "the graph returns it more than once"
    if not any(u is not output for u in node.users):
        return "the graph does not use it (its gradient only comes from outside)"
    if in_place_writers(node) or in_place_writers(x) or in_place_writers(weight):
        return "it, its input or its weight is written in place"
    return None


def detach_returned_linear_outputs(gm: torch.fx.GraphModule) -> list[ReturnedLinear]:
    """Rewrite gm's outputs as the module docstring says; returns what wrap() needs to undo it."""
    graph = gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    if len(output.args) != 1 or not isinstance(output.args[0], (tuple, list)):
        return []
    inputs = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    outputs = list(output.args[0])
    splits, extras = [], []
    for index, node in enumerate(outputs):
        if not is_op(node, "linear"):
            continue
        reason = _why_not(node, output, outputs)
        if reason is not None:
            log.debug("returned Linear output %s keeps its in-graph gradient: %s", node.name, reason)
            continue
        x, weight, bias = linear_operands(node)
        with graph.inserting_before(output):
            detached = graph.call_method("detach", (node,))
        detached.meta["example_value"] = tensor_meta(node).detach()
        outputs[index] = detached
        splits.append(ReturnedLinear(index, len(outputs) + len(extras), inputs[weight],
                                     inputs[bias] if bias is not None else None))
        extras.append(x)
        record_rewrite(FAMILY, "F.linear output returned and used in the graph",
                       "detached output + the Linear's backward outside the graph", node)
    if splits:
        output.args = (type(output.args[0])(outputs + extras),)
        gm.recompile()
    return splits


def wrap(compiled, splits: list[ReturnedLinear]):
    """The compiled function with the graph's original outputs: each split output gets its gradient edge
    back (in grad mode), the appended inputs x are dropped."""
    num_outputs = min(split.x_output for split in splits)  # the x's come after the graph's own outputs

    def run(*args):  # dynamo calls a backend's function with the graph's inputs as arguments
        returned = compiled(*args)
        results = list(returned)
        if torch.is_grad_enabled():
            for split in splits:
                x, weight = results[split.x_output], args[split.weight_input]
                bias = args[split.bias_input] if split.bias_input is not None else None
                if any(t is not None and t.requires_grad for t in (x, weight, bias)):
                    results[split.index] = _ReturnedLinear.apply(results[split.index], x, weight, bias)
        del results[num_outputs:]
        return type(returned)(results) if isinstance(returned, (tuple, list)) else results

    return run
