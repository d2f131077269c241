"""The `flash` dynamo backend: our FX rewrites, then Inductor for everything else.

    torch.compile(model, backend="flash")               # found through the setup.py entry point
    torch.compile(model, backend="flash", mode="reduce-overhead", dynamic=True, fullgraph=True)

The rewrites run as Inductor's pre-grad custom pass, on the Torch IR dynamo hands us, so the fused
ops enter AOTAutograd with their registered autograd (training and inference alike). What no pattern
matches is compiled by Inductor exactly as ``backend="inductor"`` would, with the same modes and
options, with one exception: Inductor's coalescing tiling analysis is off (flash_backend/config.py says
why and how to turn it back on). Without a GPU the fused ops run their plain-PyTorch reference
implementation.
"""

from __future__ import annotations

import logging

import torch

from flash_backend import config as flash_config
from flash_backend import returned_linear

log = logging.getLogger("flash_backend")

_COALESCE_TILING = "triton.coalesce_tiling_analysis"


def _has_inductor_option(name: str) -> bool:
    """Whether this torch's Inductor config has the (dotted) option: older releases lack newer ones."""
    from fx_passes._compat import inductor_config

    node = inductor_config
    for part in name.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


def flash_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None,
                  options: dict | None = None):
    from flash_backend import _early_kernel_compile, _ttir_memo
    from fx_passes import FlashGraphPass, mark_subgraph_entry_states
    from fx_passes._compat import compile_fx, inductor_config, list_mode_options
    from fx_passes._report import committed_only

    _ttir_memo.install()  # Inductor re-generates our kernels' Triton IR per call site otherwise
    _early_kernel_compile.install()  # our kernels compile while Inductor generates the rest of the graph
    config_patches: dict = {}
    if mode is not None and mode != "default":
        config_patches.update(list_mode_options(mode))
    if not flash_config.inductor_coalesce_tiling_analysis and _has_inductor_option(_COALESCE_TILING):
        config_patches[_COALESCE_TILING] = False  # why: flash_backend/config.py
    if options:
        # the caller's options win; spelt as torch.compile takes them for Inductor ("epilogue-fusion" is
        # epilogue_fusion: _TorchCompileInductorWrapper.apply_options), else refused by config.patch
        config_patches.update({key.replace("-", "_"): value for key, value in options.items()})
    user_pass = config_patches.get("pre_grad_custom_pass", inductor_config.pre_grad_custom_pass)
    config_patches["pre_grad_custom_pass"] = FlashGraphPass(chained=user_pass)
    log.debug("flash backend: compiling a graph of %d nodes", len(gm.graph.nodes))
    with committed_only():  # a compile that dynamo restarts is not counted (fx_passes/_report.py)
        returned = _detach_returned_logits(gm)
        mark_subgraph_entry_states(gm)  # Inductor runs the passes on each subgraph alone
        compiled = compile_fx(gm, example_inputs, config_patches=config_patches)
    return returned_linear.wrap(compiled, returned) if returned else compiled


def _detach_returned_logits(gm: torch.fx.GraphModule) -> list:
    """The returned Linear outputs whose gradient is taken outside the compiled graph
    (flash_backend/returned_linear.py). Only in grad mode: dynamo compiles a graph per grad mode, and
    without it no output has a gradient to move."""
    if not flash_config.detach_returned_logits or not torch.is_grad_enabled():
        return []
    return returned_linear.detach_returned_linear_outputs(gm)


def rewrite_only_backend(gm: torch.fx.GraphModule, example_inputs):
    """Runs the rewrites (and the returned-logits split of flash_backend) and then the rewritten graph as
    plain PyTorch (no Inductor).

    What explain() uses: it shows what the passes decide without paying for an Inductor compile.
    """
    from fx_passes import mark_subgraph_entry_states, run_passes
    from fx_passes._report import committed_only

    with committed_only():
        returned = _detach_returned_logits(gm)
        mark_subgraph_entry_states(gm)
        run_passes_with_subgraphs(gm, run_passes)
    return returned_linear.wrap(gm.forward, returned) if returned else gm.forward


def run_passes_with_subgraphs(gm: torch.fx.GraphModule, graph_pass) -> None:
    """graph_pass on the graphs of gm's subgraph modules (recursively, innermost first), then on gm's: what
    Inductor does with its pre-grad passes (compile_fx._recursive_pre_grad_passes). Dynamo puts the body of a
    ``torch.utils.checkpoint`` call (tag_activation_checkpoint) in such a subgraph: run on gm's graph alone,
    explain() reported no rewrite in a model that checkpoints its blocks, which backend="flash" rewrites."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, child in gm.named_children():
        if name in used and isinstance(child, torch.fx.GraphModule):
            run_passes_with_subgraphs(child, graph_pass)
    graph_pass(gm.graph)
