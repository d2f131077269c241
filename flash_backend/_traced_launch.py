"""The `launch=` our ops' bodies give their launchers: `wrap_triton`, with one kernel object per launch shape.

Why: a kernel launched through `wrap_triton(kernel)[grid](..., num_warps=w)` is traced by torch as a fresh
single-config Autotuner around the kernel, built anew at every call site in every tracing phase, and each
fresh object takes a new row of torch's process-wide kernel side table (torch._higher_order_ops.
triton_kernel_wrap.kernel_side_table), which is never emptied. Inductor then writes a repro of every row
into a string for each graph it compiles (compile_fx: save_graph_repro, an ast.parse of the kernel's
source per row), whether or not anything reads it: 1.1-1.5 s of BERT-base's first step on the H200
against Inductor's 0.03 s (bench/logs/first_step_bert_*_h200.log), and growing with every model a
process compiles.

What this does: the launch options (num_warps, num_stages, ...) go into a single-config Autotuner built
once per (kernel, options), the very object torch would have built (`triton.autotune(configs=
[triton.Config({}, **options)], key=[])`), and that object goes through `wrap_triton`. Traced, the side
table holds one row per kernel and launch shape; Inductor generates the same launch. Run outside tracing
(an op called eagerly through the dispatcher), the Autotuner has one config and runs it without timing.
"""

from __future__ import annotations

import functools

import triton
from torch.library import wrap_triton

# The launch options torch's tracing moves from a launch's kwargs into an Autotuner config
# (torch._higher_order_ops.triton_kernel_wrap: SPECIAL_CONFIG_NAMES).
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


@functools.cache
def single_config_kernel(kernel, options: tuple):
    """The one Autotuner for kernel launched with options (sorted (name, value) pairs)."""
    return triton.autotune(configs=[triton.Config({}, **dict(options))], key=[])(kernel)


class traced_launch:  # noqa: N801 - used like the function it stands in for: launch(kernel)[grid](...)
    """`traced_launch(kernel)[grid](*args, **kwargs)`: wrap_triton's launch with the options in a shared
    single-config Autotuner."""

    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            options = tuple(sorted((name, kwargs.pop(name)) for name in _LAUNCH_OPTIONS if name in kwargs))
            kernel = single_config_kernel(self.kernel, options) if options else self.kernel
            return wrap_triton(kernel)[grid](*args, **kwargs)

        return run
