"""Returning a computed result as an op output, in the layout the op's fake allocates.

The bodies of our ops run under Inductor's tracing wherever they do not launch our kernels (the CPU
reference, CUDA fallbacks). A body that allocates its outputs and fills them with ``out.copy_(result)``
produced wrong results there: when ``out`` has ``result``'s exact layout, Inductor's post-grad
``remove_noop_ops`` drops the copy and hands out ``result``'s buffer, after AOTAutograd has already chosen,
from the traced storages, which saved tensors the backward may overwrite. A saved intermediate that in fact
was the user's output then got overwritten: an affine-free LayerNorm returned as a view (``ln(x)[:, 0]``)
changed values after ``backward()`` (tests/test_op_outputs_after_backward.py). Traced, the result itself is
returned, so AOTAutograd sees the aliasing; a copy is kept only where it changes the layout, and Inductor
keeps those. Called eagerly on real tensors (the registered CPU kernels) the copy stays: there the result
may be a view of a temporary, and autograd forbids in-place writes to a custom op's view outputs.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq


def as_output(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`result` in `like`'s dtype and layout (`like`: the output as the fake allocates it, unwritten).
    `result` must be a fresh tensor (not a view of an op input): an op's outputs may not alias its inputs."""
    result = result.to(like.dtype)
    same_layout = statically_known_true(sym_eq(result.shape, like.shape)) and statically_known_true(
        sym_eq(result.stride(), like.stride()))
    if same_layout and _traced(result):
        return result
    return like.copy_(result)  # eager, or a change of layout (not a no-op: Inductor keeps the copy)


def _traced(t: torch.Tensor) -> bool:
    """t is a tracing stand-in (fake or functionalised), not a tensor with data."""
    return isinstance(t, (FakeTensor, FunctionalTensor)) or torch._is_functional_tensor(t)
