"""Compile-time cache: Inductor's Triton-IR generation for our kernels, done once per specialisation.

Why: our CUDA ops are `triton_op`s, so Inductor traces into their Triton kernels. To learn which tensors a
kernel writes, torch (torch._higher_order_ops.triton_kernel_wrap.generate_ttir) runs Triton's front end on
the kernel's source. It does so for every call site, in every tracing phase (AOT metadata collection, the
joint-graph trace, functionalisation, lowering), with no cache: GPT-2's 12 attention and 25 norm call
sites re-generated the same IR of six kernels 331 times, ~18 s of a 51 s first (compiling) training step
on the H200, against Inductor's 27 s. With this cache: 16 generations, 0.9 s, a 26 s first step
(bench/profile_first_step.py; bench/logs/first_step_gpt2_*_h200.log).

What is cached: generate_ttir's result and the write analysis torch builds on it (identify_*_tensors),
only for kernels defined in flash_backend, keyed on exactly what those functions read: the kernel object,
and for every argument its name and either its dtype (fake tensors and Inductor buffers: generate_ttir
replaces them with `torch.empty(2, dtype)`; the analyses also key on which of the two it is), the marker
"symbolic" (SymInt, SymFloat, SymBool, sympy: replaced with 2), or its value and type (everything else).
Each is a deterministic function of that key, so a hit returns what a fresh call would build.
Anything the key cannot describe exactly (a real tensor, whose address alignment Triton specialises on;
TMA descriptor metadata; an unhashable value) is not cached and goes to torch's functions unchanged.

Installed by the `flash` backend before it compiles (flash_backend/backend.py); a torch without these
functions (the API is private) simply gets no cache.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
import types

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensor
from triton.runtime.autotuner import Autotuner

log = logging.getLogger("flash_backend")

_OUR_PACKAGE = "flash_backend."
_NOT_CACHEABLE = object()


def _is_our_kernel(kernel) -> bool:
    # Autotuner/Heuristics wrap a JITFunction in .fn, which wraps the Python function in .fn.
    fn = kernel
    for _ in range(4):
        if isinstance(fn, types.FunctionType):
            return fn.__module__.startswith(_OUR_PACKAGE)
        fn = getattr(fn, "fn", None)
    return False


def _argument_key(value, tensor_kind: bool = True):
    """What generate_ttir sees of one argument, or _NOT_CACHEABLE; tensor_kind=False keys a fake tensor and
    an Inductor buffer of one dtype alike (generate_ttir itself cannot tell them apart)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
        return ("symbolic",)
    inductor_ir = sys.modules.get("torch._inductor.ir")  # only Inductor's lowering passes its buffers
    if isinstance(value, FakeTensor) or (inductor_ir and isinstance(value, inductor_ir.TensorBox)):
        # Both become torch.empty(2, dtype) for the IR; the analysis may tell them apart (a TensorBox is not
        # a torch.Tensor), so its key holds the kind.
        return ("tensor", type(value).__name__ if tensor_kind else "any", value.dtype)
    if isinstance(value, torch.Tensor):
        return _NOT_CACHEABLE  # a real tensor: Triton specialises on its address alignment
    try:
        hash(value)
    except TypeError:
        return _NOT_CACHEABLE
    return ("value", type(value), value)


def _kernel_identity(kernel):
    """(the object to key on, the autotuning kwargs generate_ttir merges in), or None.

    A launch with num_warps/num_stages is traced as a fresh single-config Autotuner around our JITFunction,
    one per call site; generate_ttir unwraps it and merges its first config's kwargs. (It builds the IR
    with default options; the config's launch options are in the key all the same, so that no hit ever
    depends on that detail of torch's.)"""
    if not isinstance(kernel, Autotuner):
        return kernel, ()
    config = kernel.configs[0] if kernel.configs else None
    config_kwargs = config.kwargs if config is not None else {}
    parts = [("launch options", tuple(repr(getattr(config, option, None))
                                      for option in ("num_warps", "num_stages", "num_ctas", "maxnreg")))]
    for name in sorted(config_kwargs):
        key = _argument_key(config_kwargs[name])
        if key is _NOT_CACHEABLE:
            return None
        parts.append((name, key))
    return kernel.fn, tuple(parts)


def _cache_key(kernel, kwargs, tma_descriptor_metadata, tensor_kind: bool = True):
    """(inner kernel, hashable key) or None when the call must not be cached."""
    if tma_descriptor_metadata or not isinstance(kwargs, dict) or not _is_our_kernel(kernel):
        return None
    identity = _kernel_identity(kernel)
    if identity is None:
        return None
    inner, config_parts = identity
    parts = []
    for name in sorted(kwargs):
        key = _argument_key(kwargs[name], tensor_kind)
        if key is _NOT_CACHEABLE:
            return None
        parts.append((name, key))
    return inner, (id(inner), config_parts, tuple(parts))


def _memoize(function, copy_result, tensor_kind: bool = True):
    """Cache `function(kernel, kwargs, tma_descriptor_metadata)` for our kernels; `copy_result` gives each
    caller its own copy of the mutable parts of a cached result; tensor_kind: whether fake tensors and
    Inductor buffers of one dtype are told apart in the key (see _WRAPPED)."""
    cache: dict = {}

    @functools.wraps(function)
    def memoized(kernel, kwargs, tma_descriptor_metadata=None, *args, **kw):
        keyed = (_cache_key(kernel, kwargs, tma_descriptor_metadata, tensor_kind)
                 if not args and not kw else None)
        if keyed is None:
            return function(kernel, kwargs, tma_descriptor_metadata, *args, **kw)
        inner, key = keyed
        hit = cache.get(key)
        if hit is not None and hit[0] is inner:  # the entry holds the kernel, so its id is not reused
            return copy_result(hit[1])
        result = function(kernel, kwargs, tma_descriptor_metadata)
        cache[key] = (inner, copy_result(result))
        return result

    memoized._flash_cache = cache
    return memoized


def _copy_ttir(result):
    ttir_module, ordered_arg_names = result  # the module is only read by its callers
    return ttir_module, list(ordered_arg_names)


# What is wrapped, per torch release: generate_ttir everywhere; the analysis built on it (which also walks
# the IR) under its 2.11 name (a list of written argument names) and its later one (read/write sets).
_WRAPPED = {
    "generate_ttir": _copy_ttir,
    "identify_mutated_tensors": list,
    "identify_accessed_tensors": copy.deepcopy,
}
# generate_ttir turns a fake tensor and an Inductor buffer alike into torch.empty(2, dtype), so one entry
# serves the tracing phases (fake tensors) and Inductor's lowering (buffers): half the IR generations, ~60 ms
# each for our kernels. The analyses keep the kind in their key (see _argument_key).
_TENSOR_KIND_BLIND = frozenset({"generate_ttir"})


def install() -> bool:
    """Wrap torch's functions with the cache (idempotent). False when this torch has none of them."""
    try:
        from torch._higher_order_ops import triton_kernel_wrap
    except ImportError:
        return False
    installed = False
    for name, copy_result in _WRAPPED.items():
        current = getattr(triton_kernel_wrap, name, None)
        if current is None:
            continue
        if not hasattr(current, "_flash_cache"):
            setattr(triton_kernel_wrap, name,
                    _memoize(current, copy_result, tensor_kind=name not in _TENSOR_KIND_BLIND))
        installed = True
    if not installed:
        log.debug("torch has no triton_kernel_wrap.generate_ttir: no Triton-IR cache for our kernels")
    return installed
