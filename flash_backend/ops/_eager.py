"""The eager fast path: plain eager calls run an op's launchers through a torch.autograd.Function.

Why: on the H200 host, a call of a registered custom op with autograd (`torch.ops.flash.*` -> dispatcher
-> Python autograd kernel -> redispatch -> the triton_op body) measured 0.10 ms of host time for an
attention forward whose bare kernel launch takes 0.043 ms (bench/NOTES_attention.md, session 2): more
than the kernels of a small attention or of a LayerNorm over a few MB take on the GPU.

What stays on the registered op: anything traced or transformed — torch.compile / export / make_fx (fake
or functional tensors, dispatch or function modes), torch.func transforms, tensor subclasses — and CPU
tensors (the reference path). Those are exactly what opcheck and the compile tests cover; the fast path
runs the very same launcher functions with plain Triton launches instead of `wrap_triton`, and the cuda
tests compare it with the op path bit for bit.
"""

from __future__ import annotations

import torch

from flash_backend import config
from flash_backend._fast_launch import fast_kernel


def plain_launch(kernel):
    """The `launch=` argument of our launchers for direct calls: `kernel[grid](...)` as Triton runs it,
    minus Triton's per-call specialization once a specialization has been compiled (_fast_launch.py)."""
    return fast_kernel(kernel)


def direct_call_ok(*tensors, device_type: str = "cuda") -> bool:
    """True when tensors (None allowed) may skip the dispatcher: plain CUDA tensors, nothing tracing.

    device_type is a parameter so that the CPU tests can check every other condition."""
    if not config.eager_direct_calls:
        return False
    if torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._len_torch_dispatch_stack() > 0 or torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    for t in tensors:
        if t is None:
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != device_type:
            return False
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            return False
    return True


def needs_autograd(*tensors) -> bool:
    """Whether a direct call has to go through its autograd.Function: grad mode is on and some input
    (None allowed) requires grad. Otherwise the Function would record nothing, and calling the launchers
    bare skips Function.apply's host time (~10 us on our CPU machine, ~3x that on the H200 host). The
    launchers allocate every output, so no output aliases an input either way."""
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


_ABSENT_POINTERS: dict = {}


def absent_pointer(like: torch.Tensor, launch) -> torch.Tensor:
    """A 1-element tensor of like's dtype and device passed where a kernel has an optional pointer it is
    told (by a constexpr) never to read or write.

    Direct calls (launch=plain_launch) share one per (device, dtype): an allocation per launch was ~4 us of
    an eager attention's host time on the H200 host. Traced launches allocate it, so that it is part of
    the graph like any other tensor."""
    if launch is not plain_launch:
        return like.new_empty(1)
    key = (like.device, like.dtype)
    t = _ABSENT_POINTERS.get(key)
    if t is None:
        t = _ABSENT_POINTERS[key] = like.new_empty(1)
    return t
