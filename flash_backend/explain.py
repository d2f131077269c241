"""flash_backend.explain: which subgraphs the flash backend rewrites, and which it leaves alone and why."""

from __future__ import annotations

import torch

from fx_passes._report import Report, collecting


def explain(model, *example_inputs, print_report: bool = True, dynamic: bool | None = None,
            **example_kwargs) -> Report:
    """Trace model on the example inputs, run the flash rewrites, and report every decision.

    The model runs once (in its current train/eval mode) through the rewritten graph, without
    Inductor. The same lines are logged through the ``flash_backend`` logger at INFO level during any
    ``torch.compile(..., backend="flash")``.

        report = flash_backend.explain(model, x)
        report.counts()        # Counter({"norm": 12, "attention": 6})
        report.near_misses     # [Decision(family, False, variant, reason, location), ...]
    """
    from flash_backend.backend import rewrite_only_backend

    # A backend object of its own makes dynamo trace afresh rather than reuse an earlier compile.
    def backend(gm, inputs):
        return rewrite_only_backend(gm, inputs)

    with collecting() as report:
        compiled = torch.compile(model, backend=backend, dynamic=dynamic)
        compiled(*example_inputs, **example_kwargs)
    if print_report:
        print(report)
    return report
