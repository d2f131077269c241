"""The `flash` dynamo backend: our FX rewrites, then Inductor for everything else.

    torch.compile(model, backend="flash")               # found through the setup.py entry point
    torch.compile(model, backend="flash", mode="reduce-overhead", dynamic=True, fullgraph=True)

The rewrites run as Inductor's pre-grad custom pass, on the Torch IR dynamo hands us, so the fused
ops enter AOTAutograd with their registered autograd (training and inference alike). What no pattern
matches is compiled by Inductor exactly as ``backend="inductor"`` would, with the same modes and
options. Without a GPU the fused ops run their plain-PyTorch reference implementation.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("flash_backend")


def flash_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None,
                  options: dict | None = None):
    from flash_backend import _ttir_memo
    from fx_passes import FlashGraphPass
    from fx_passes._compat import compile_fx, inductor_config, list_mode_options

    _ttir_memo.install()  # Inductor re-generates our kernels' Triton IR per call site otherwise
    config_patches: dict = {}
    if mode is not None and mode != "default":
        config_patches.update(list_mode_options(mode))
    if options:
        config_patches.update(options)
    user_pass = config_patches.get("pre_grad_custom_pass", inductor_config.pre_grad_custom_pass)
    config_patches["pre_grad_custom_pass"] = FlashGraphPass(chained=user_pass)
    log.debug("flash backend: compiling a graph of %d nodes", len(gm.graph.nodes))
    return compile_fx(gm, example_inputs, config_patches=config_patches)


def rewrite_only_backend(gm: torch.fx.GraphModule, example_inputs):
    """Runs the rewrites and then the rewritten graph as plain PyTorch (no Inductor).

    What explain() uses: it shows what the passes decide without paying for an Inductor compile.
    """
    from fx_passes import run_passes

    run_passes(gm.graph)
    return gm.forward
