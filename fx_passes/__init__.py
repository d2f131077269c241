"""FX passes that rewrite Torch-IR subgraphs into `torch.ops.flash` fused ops.

One module per fusion family (``norm``, ``attention``, ``dense``, ...). A family module defines

    FAMILY: str                      # counter key: counters["flash"][FAMILY]
    ORDER: int                       # families run in ascending ORDER (default 50)
    def rewrite(graph: torch.fx.Graph) -> None
        # find candidate subgraphs, prove each is the same function, replace it, and report every
        # rewrite and near miss through fx_passes._report (record_rewrite / record_near_miss)

and is discovered automatically: adding a fusion touches one file here and nothing else.

The passes run on the graph dynamo produces, before AOTAutograd (Inductor's ``pre_grad_custom_pass``
hook). Working there means the fused op's registered autograd gives the backward: training and
inference share one pattern, and Inductor compiles the rest of the graph exactly as it would.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from pathlib import Path

import torch.fx

from fx_passes._compat import CustomGraphPass, get_hash_for_files, stable_topological_sort
from fx_passes._functionalize import functionalize_in_place
from fx_passes._match import erase_dead_code
from fx_passes._report import Report, collecting  # noqa: F401  (re-exported)

log = logging.getLogger("flash_backend")


def family_modules() -> list:
    modules = [
        importlib.import_module(f"{__name__}.{m.name}")
        for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_")
    ]
    return sorted(modules, key=lambda m: (getattr(m, "ORDER", 50), m.FAMILY))


def run_passes(graph: torch.fx.Graph, families: set[str] | None = None) -> None:
    """Apply every fusion family (or only those named) to graph, in place."""
    import flash_backend.ops  # noqa: F401  (the replacements call torch.ops.flash.*)

    # The passes evaluate a few things on real tensors (constants, GELU regions on a grid). Under no_grad
    # those record nothing: a first call inside torch.utils.checkpoint compiles in the checkpoint's
    # saved-tensor hooks, which count every tensor saved (more than the recomputation saves: CheckpointError).
    # The grad mode the graph was traced in (dynamo guards on it) is its entry state (_match.state_regions).
    graph._flash_entry_grad_enabled = getattr(graph, "_flash_subgraph_entry_grad", torch.is_grad_enabled())
    # Likewise the devices whose autocast is off on entry; a subgraph's entry is its call's, not known here
    subgraph = hasattr(graph, "_flash_subgraph_entry_grad")
    graph._flash_entry_autocast_off = frozenset() if subgraph else frozenset(
        d for d in _autocast_devices(graph) if not torch.is_autocast_enabled(d))
    with torch.no_grad():
        functionalize_in_place(graph)
        # A node nobody reads is no other user of an intermediate: erased once here, for every family
        # (openai/whisper's dropped qk.detach() blocked its attention; review s32, A2)
        erase_dead_code(graph)
        for module in family_modules():
            if families is None or module.FAMILY in families:
                module.rewrite(graph)
    stable_topological_sort(graph)
    graph.lint()
    if graph.owning_module is not None:
        graph.owning_module.recompile()


def _autocast_devices(graph: torch.fx.Graph) -> set[str]:
    """The device types the graph's ``torch.autocast`` blocks name."""
    return {n.args[0] for n in graph.nodes if n.op == "call_function" and n.args and
            isinstance(n.args[0], str) and getattr(n.target, "__name__", None) == "_enter_autocast"}


def mark_subgraph_entry_states(gm: torch.fx.GraphModule, entry=None) -> None:
    """Record on each subgraph of gm (recursively) the grad mode it is called in, for run_passes.

    Inductor runs its pre-grad passes, ours among them, on every subgraph (the body of a
    ``torch.utils.checkpoint`` call, tag_activation_checkpoint, ...) as a graph of its own, without the call
    around it. Its entry state is not the grad mode of the compile when the call sits in a ``torch.no_grad()``
    block of gm: a pattern inside an ``enable_grad()`` block of such a body was taken to run in the body's
    entry state, its fused call placed before the block, under no_grad, and its parameters got no gradient.
    The body of a checkpoint runs in the grad mode of its call; a body called in two modes, or in one gm
    does not tell, or the body of another higher-order op gets a state of its own that no region equals (a
    pattern across a grad-mode change in it is left alone)."""
    checkpoint_hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    grad = torch.is_grad_enabled() if entry is None else entry
    states: dict[torch.fx.GraphModule, object] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if getattr(n.target, "__name__", "").endswith("set_grad_enabled"):
            grad = n.args[0] if n.args and isinstance(n.args[0], bool) else ("unknown", n)
        inputs: list[torch.fx.Node] = []
        torch.fx.node.map_arg((n.args, n.kwargs), inputs.append)
        for arg in inputs:
            child = getattr(gm, arg.target, None) if arg.op == "get_attr" else None
            if isinstance(child, torch.fx.GraphModule):
                state = grad if n.target is checkpoint_hop else ("unknown", n)
                states[child] = state if states.get(child, state) == state else ("unknown", child)
    for child, state in states.items():
        child.graph._flash_subgraph_entry_grad = state
        mark_subgraph_entry_states(child, state)


class FlashGraphPass(CustomGraphPass):
    """The flash rewrites as an Inductor pre-grad custom pass, with a uuid for the FX graph cache."""

    def __init__(self, chained=None):
        # A pre_grad_custom_pass the user had configured still runs, after ours.
        self.chained = chained

    def __call__(self, graph: torch.fx.Graph) -> None:
        run_passes(graph)
        if self.chained is not None:
            self.chained(graph)

    def uuid(self):
        # The rewrite depends on the pass sources and on the ops they call.
        root = Path(__file__).resolve().parent
        files = sorted(root.glob("*.py")) + sorted((root.parent / "flash_backend" / "ops").glob("*.py"))
        chained = self.chained.uuid() if hasattr(self.chained, "uuid") else None
        # ...and on the switches that gate rewrites (flash_backend/config.py): a graph compiled with a
        # switch on must not be served from the cache to a process that has it off.
        from flash_backend import config

        switches = (config.route_sdpa_calls_on_cuda, config.dense_training_on_cuda,
                    config.cross_entropy_on_cuda)
        return (get_hash_for_files(tuple(str(f) for f in files)), chained, switches)
