"""Every import of torch._inductor / torch._dynamo internals lives here.

Those APIs move between torch releases; the project runs on torch 2.11 (GPU machine) and 2.13 (CPU/CI).
"""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor import list_mode_options
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

try:
    from torch._inductor.pattern_matcher import stable_topological_sort
except ImportError:  # moved in some releases
    from torch._inductor.fx_passes.pre_grad import stable_topological_sort  # type: ignore[no-redef]

try:
    from torch._guards import detect_fake_mode
except ImportError:  # pragma: no cover - older layout
    from torch._dynamo.utils import detect_fake_mode  # type: ignore[no-redef]

try:
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch.utils._sympy.symbol import SymT, symbol_is_type
except ImportError:  # pragma: no cover - a torch without dynamic float inputs
    TensorifyScalarRestartAnalysis = TensorifyState = SymT = symbol_is_type = None


def restart_with_specialised_floats(symbols) -> None:
    """Ask dynamo to retrace with these float-input symbols (zf0, ...) as constants.

    A backend that bakes in the value of a dynamic float input (dynamic=True turns module float attributes
    into graph inputs) raises this, as Inductor's tensorify pass does. Symbols already marked, or not
    float inputs, or a torch without the mechanism: nothing is raised, the caller's guard is enough.
    """
    if TensorifyState is None:
        return
    names = {str(s) for s in symbols if symbol_is_type(s, SymT.FLOAT)}
    names = {n for n in names if not TensorifyState.should_specialize(n)}
    if not names:
        return
    for name in sorted(names):
        TensorifyState.specialize(name)
    raise TensorifyScalarRestartAnalysis


def float_input_symbols(value) -> set | None:
    """The float-input symbols (zf0, ...) a SymFloat is computed from when it is computed from those alone
    (``math.sqrt(2 / math.pi)`` with math.pi a dynamic float input), else None (a size, a data-dependent
    value, a torch without dynamic float inputs)."""
    expr = getattr(getattr(value, "node", None), "_expr", None)
    if SymT is None or not isinstance(value, torch.SymFloat) or expr is None or not expr.free_symbols:
        return None
    symbols = set(expr.free_symbols)
    return symbols if all(symbol_is_type(s, SymT.FLOAT) for s in symbols) else None


__all__ = [
    "float_input_symbols",
    "CustomGraphPass",
    "compile_fx",
    "counters",
    "detect_fake_mode",
    "get_hash_for_files",
    "inductor_config",
    "list_mode_options",
    "restart_with_specialised_floats",
    "stable_topological_sort",
]
