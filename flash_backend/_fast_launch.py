"""Launch a compiled Triton / Gluon kernel again without Triton's per-call specialization.

Why: on the H200 host `kernel[grid](*args)` costs 47-55 us of host time for our attention forward (44
positional arguments, 17 constexprs), of which 18-20 us are Triton's binder (one specialization call per
argument), and the rest the cache-key string, the launch metadata and the driver launch; the compiled
kernel's own launcher takes 11-13 us (scratch probe of session 24). Eager calls of small attention, ViT's
or BERT's, are bound by that host time, not by the GPU.

How, and why it is exact: Triton compiles one kernel per *specialization* of the arguments, and that
specialization is a function of
- each tensor's dtype and whether its data pointer is 16-byte aligned,
- each int's value (i32 / i64 / u64 by range, == 1, divisible by 16), floats and bools by type,
- a Gluon tensor descriptor's dtype, shape, strides, block shape, layout and padding,
- the constexpr arguments and the launch options (num_warps, num_stages, maxnreg, ...),
- the current device, and Triton's debug and instrumentation settings.
`FastKernel` keys its own cache on a superset of that information (ints and floats by exact value, every
argument's type), so one key never maps to two different Triton specializations: the first call with a
key goes through `kernel[grid](...)`, which compiles (or finds) the kernel and launches it, and the
`CompiledKernel` it returns is stored; later calls with that key call the compiled kernel's launcher
directly, with the arguments in the kernel's parameter order, as `JITFunction.run` does.
Anything this module does not know how to key (another argument type, a callable grid, an unhashable
constexpr, launch hooks registered by a profiler, pre-run hooks) takes Triton's own path, every time.
Not repeated: Triton's check that the globals a kernel read have not changed since it was compiled (ours
read module constants only).
"""

from __future__ import annotations

import inspect
import operator

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

try:  # Gluon's host-side TMA descriptor (Triton >= 3.5); absent, no argument can be one
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
except ImportError:  # pragma: no cover - depends on the Triton build
    _GluonDescriptor = None

# Per kernel, at most this many specializations are kept; past it the cache starts over (a model whose
# shapes keep changing still launches correctly, through Triton's path on each first call).
MAX_ENTRIES = 512

_SCALARS = (int, float, bool, type(None))
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_UNKEYABLE = object()  # marks an argument the key cannot describe: take Triton's path


def _descriptor_key(d):
    """What of a Gluon tensor descriptor can change the compiled kernel, hashable."""
    if not isinstance(d.base, torch.Tensor):
        return _UNKEYABLE
    return (d.base.dtype, d.base.data_ptr() & 15 == 0, tuple(d.shape), tuple(d.strides), tuple(d.block_shape),
            d.layout, d.padding)


def _getter(positions):
    """args -> the tuple of args at these positions (operator.itemgetter returns a bare value for one)."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        (i,) = positions
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


def _split_by_type(types):
    """For one tuple of argument types: getters of the scalar, tensor and descriptor arguments, or None
    when some argument is of a type the key cannot describe."""
    scalars, tensors, descriptors = [], [], []
    for i, t in enumerate(types):
        if t in _SCALARS:
            scalars.append(i)
        elif t in _TENSORS:
            tensors.append(i)
        elif _GluonDescriptor is not None and t is _GluonDescriptor:
            descriptors.append(i)
        else:
            return None
    return _getter(scalars), _getter(tensors), _getter(descriptors)


class FastKernel:
    """`FastKernel(kernel)[grid](*args, **kwargs)` does what `kernel[grid](*args, **kwargs)` does."""

    def __init__(self, kernel: JITFunction):
        self.kernel = kernel
        self.params = list(inspect.signature(kernel.fn).parameters.values())
        self._compiled: dict = {}
        self._by_types: dict = {}  # tuple of argument types -> _split_by_type's getters
        self._orders: dict = {}  # (number of positional args, keyword names) -> how to complete the args

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def _order(self, n_positional: int, kw_names: tuple):
        """The parameters after the positional ones, each as (True, its name) when passed by keyword or
        (False, its default value); None when the call does not bind (Triton's path raised its own error
        then, or will)."""
        key = (n_positional, kw_names)
        order = self._orders.get(key)
        if order is None:
            if n_positional > len(self.params):
                return None
            order = []
            for p in self.params[n_positional:]:
                if p.name in kw_names:
                    order.append((True, p.name))
                elif p.default is not inspect.Parameter.empty:
                    order.append((False, p.default))
                else:
                    return None
            order = tuple(order)
            self._orders[key] = order
        return order

    def run(self, grid, args, kwargs):
        kernel = self.kernel
        runtime = knobs.runtime
        if (runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls or kernel.pre_run_hooks
                or callable(grid)):
            return kernel[grid](*args, **kwargs)
        types = tuple(map(type, args))
        split = self._by_types.get(types, _UNKEYABLE)
        if split is _UNKEYABLE:
            split = self._by_types[types] = _split_by_type(types)
        if split is None:
            return kernel[grid](*args, **kwargs)
        scalars, tensors, descriptors = split
        # Ints and floats by value (a superset of their specialization); the type tuple keeps True and 1
        # apart, which hash alike.
        tensor_keys = tuple([(t.dtype, t.data_ptr() & 15 == 0) for t in tensors(args)])
        descriptor_keys = tuple([_descriptor_key(d) for d in descriptors(args)])
        if _UNKEYABLE in descriptor_keys:
            return kernel[grid](*args, **kwargs)
        device = driver.active.get_current_device()
        key = (device, runtime.debug, knobs.compilation.instrumentation_mode, types, scalars(args),
               tensor_keys, descriptor_keys, tuple(kwargs.items()), tuple(map(type, kwargs.values())))
        try:
            entry = self._compiled.get(key)
        except TypeError:  # an unhashable constexpr or option value
            return kernel[grid](*args, **kwargs)
        if entry is None:
            compiled = kernel[grid](*args, **kwargs)
            order = self._order(len(args), tuple(kwargs))
            if compiled is not None and order is not None:
                if len(self._compiled) >= MAX_ENTRIES:
                    self._compiled.clear()
                # the parameters after the positional ones: fixed by the key, which holds kwargs' values
                tail = tuple([kwargs[x] if from_kw else x for from_kw, x in order])
                self._compiled[key] = (compiled, tail)
            return compiled
        compiled, tail = entry
        values = args + tail
        grid_0 = grid[0]
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        stream = driver.active.get_current_stream(device)
        compiled.run(grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, None, None,
                     None, *values)
        return compiled


_FAST: dict = {}  # id(kernel) -> FastKernel; kernels are module globals that live as long as it


def fast_kernel(kernel):
    """The FastKernel of a jitted Triton or Gluon kernel (one per kernel); anything else, e.g. the
    interpreter's kernels under TRITON_INTERPRET=1, is returned as it is."""
    fast = _FAST.get(id(kernel))
    if fast is None or fast.kernel is not kernel:
        if not isinstance(kernel, JITFunction) or type(kernel).run is not JITFunction.run:
            return kernel  # e.g. TRITON_INTERPRET=1's InterpretedFunction
        fast = _FAST[id(kernel)] = FastKernel(kernel)
    return fast

