"""flash_backend: fused attention, norm and dense kernels, delivered to unmodified models.

    compiled = torch.compile(model, backend="flash")   # no import needed: setup.py entry point
    flash_backend.explain(model, *example_inputs)       # what was rewritten, and the near misses

Importing this package registers the ops under `torch.ops.flash` and the SDPA backend "flash_backend"
(registered, never activated: `torch.nn.attention.activate_flash_attention_impl("flash_backend")`).
"""

import logging

from flash_backend import (
    ops,  # noqa: F401  (registers torch.ops.flash.*)
    sdpa,  # noqa: F401  (registers the SDPA impl; activates nothing)
)

logger = logging.getLogger("flash_backend")

__version__ = "0.1.0"


def __getattr__(name):
    # The compiler side pulls in torch._dynamo / torch._inductor: load it only when asked for.
    if name == "explain":
        from flash_backend.explain import explain

        # Importing the submodule bound the package attribute to the module: rebind the function.
        globals()["explain"] = explain
        return explain
    if name == "flash_backend":
        from flash_backend.backend import flash_backend

        return flash_backend
    raise AttributeError(name)
