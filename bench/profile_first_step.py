"""Where the first (compiling) training step's wall time goes: one bench_e2e config per mode, with dynamo's
per-phase compile times, every Triton compile done in this process (name and seconds), and the functions
with the most cumulative time under cProfile.

    python bench/profile_first_step.py --config gpt2-eager --modes inductor,flash [--top 30]

Modes: inductor, flash, flash_no_ttir_memo (flash without flash_backend/_ttir_memo.py). --top 0 skips
cProfile (its overhead inflates every phase ~1.5x).

A diagnostic for the first-step target of bench_e2e.py (which gives the numbers we report).
Run it in a fresh process with cold caches (TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR pointing at empty
folders) to see what a user's first run pays.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_e2e import CONFIGS, _build  # noqa: E402


def _timed(original, record):
    """original, wrapped so that each call's wall time goes to record(first argument, seconds)."""

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            record(args[0] if args else None, time.perf_counter() - t0)

    return timed


def _count_triton_compiles():
    """Wrap triton.compile so every compile done in *this* process is timed per kernel name (Inductor's
    worker processes compile elsewhere and are not seen here, which is the point: this is what blocks the
    step)."""
    import triton
    import triton.compiler
    import triton.compiler.compiler as tc

    seen: dict[str, list[float]] = defaultdict(list)

    def record(src, seconds):
        seen[getattr(getattr(src, "fn", None), "__name__", None) or type(src).__name__].append(seconds)

    # JITFunction imports `compile` from triton.compiler when it first runs; patch every name it may use.
    tc.compile = triton.compiler.compile = triton.compile = _timed(tc.compile, record)
    return seen


# torch functions whose calls and time are counted: Inductor's analysis of user-defined Triton kernels
# (what our triton_ops cost to trace) and the repro string it writes for every graph.
_TIMED = (
    ("torch._higher_order_ops.triton_kernel_wrap", "generate_ttir"),
    ("torch._higher_order_ops.triton_kernel_wrap", "ttir_to_functions"),
    ("torch._higher_order_ops.triton_kernel_wrap", "identify_mutated_tensors"),
    ("torch._higher_order_ops.triton_kernel_wrap", "identify_accessed_tensors"),
    ("torch._dynamo.repro.after_aot", "save_graph_repro"),
)


def _time_torch_functions():
    import importlib

    spent: dict[str, list[float]] = defaultdict(list)
    for module_name, name in _TIMED:
        module = importlib.import_module(module_name)
        original = getattr(module, name, None)
        if original is not None:
            setattr(module, name, _timed(original, lambda _, seconds, name=name: spent[name].append(seconds)))
    return spent


def _print_memo_entries() -> None:
    """Per kernel, how many entries flash_backend/_ttir_memo.py holds and which arguments told them apart."""
    from torch._higher_order_ops import triton_kernel_wrap

    for name in ("generate_ttir", "identify_mutated_tensors", "identify_accessed_tensors"):
        cache = getattr(getattr(triton_kernel_wrap, name, None), "_flash_cache", None)
        if not cache:
            continue
        by_kernel: dict[str, list] = defaultdict(list)
        for (_, config_parts, parts), (kernel, _) in cache.items():
            by_kernel[getattr(kernel, "__name__", repr(kernel))].append(dict(config_parts + parts))
        for kernel_name, entries in by_kernel.items():
            varying = {arg: {repr(e.get(arg))[:40] for e in entries} for arg in entries[0]}
            varying = {arg: values for arg, values in varying.items() if len(values) > 1}
            print(f"memo {name} {kernel_name}: {len(entries)} entries; differ in {varying}"[:600])


def _print_kernel_bookkeeping() -> None:
    """Rows of torch's kernel side table (flash_backend/_traced_launch.py), our kernels submitted at codegen
    and the module loads that found a submitted compile (flash_backend/_early_kernel_compile.py)."""
    from torch._dynamo.utils import counters
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    from flash_backend import _early_kernel_compile

    hits, misses = (counters["inductor"][f"async_compile_cache_{kind}"] for kind in ("hit", "miss"))
    print(f"kernel side table rows {len(kernel_side_table.id_to_kernel)}; our kernels submitted at codegen "
          f"{sum(_early_kernel_compile.submitted.values())}; async_compile cache hits {hits} of "
          f"{hits + misses}")


def profile_mode(config: str, mode: str, top: int, seen, spent) -> None:
    from flash_backend import _ttir_memo
    from flash_backend.backend import flash_backend as flash_backend_fn

    if mode == "flash_no_ttir_memo":  # the A/B of flash_backend/_ttir_memo.py
        _ttir_memo.install = lambda: False
    torch._dynamo.reset()
    seen.clear()
    spent.clear()
    net, inputs, _ = _build(*CONFIGS[config])
    forward = torch.compile(net, backend="inductor" if mode == "inductor" else flash_backend_fn)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=True)
    torch.cuda.synchronize()
    profiler = cProfile.Profile() if top > 0 else None
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    forward(**inputs).loss.backward()
    opt.step()
    torch.cuda.synchronize()
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - t0
    print(f"\n===== {config} {mode}: first step {wall:.2f} s =====")
    print(torch._dynamo.utils.compile_times(repr="str", aggregate=True))
    total = sum(sum(v) for v in seen.values())
    print(f"triton.compile in this process: {total:.2f} s over {sum(len(v) for v in seen.values())} compiles")
    for name, times in sorted(seen.items(), key=lambda kv: -sum(kv[1]))[:20]:
        print(f"  {name[:60]:60s} n={len(times):3d} {sum(times):7.2f} s")
    for name, times in spent.items():
        print(f"torch {name:40s} calls={len(times):4d} {sum(times):7.2f} s")
    _print_kernel_bookkeeping()
    _print_memo_entries()
    if not profiler:
        return
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    print(out.getvalue()[:20000])  # the header and the top of the cumulative ranking


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="gpt2-eager", choices=sorted(CONFIGS))
    parser.add_argument("--modes", default="inductor,flash")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    import flash_backend  # noqa: F401

    torch.backends.cuda.matmul.allow_tf32 = True
    seen = _count_triton_compiles()
    spent = _time_torch_functions()
    for mode in args.modes.split(","):
        profile_mode(args.config, mode, args.top, seen, spent)


if __name__ == "__main__":
    main()
