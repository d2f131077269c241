"""Forward-mode AD is refused, loudly.

Our ops define backward formulas only. Called on dual tensors (torch.autograd.forward_ad) or under
torch.func.jvp / jacfwd, a torch.library custom op returns outputs with no tangent, or a zero one: a silently
wrong Jacobian-vector product. The public functions call `refuse_forward_ad` first, so such a call raises
instead. Outside forward AD it costs two cheap checks.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as forward_ad
from torch._C._functorch import TransformType, peek_interpreter_stack


def refuse_forward_ad(name: str, *tensors) -> None:
    """Raise NotImplementedError when forward-mode AD would see this call (tensors: the inputs, None
    allowed). Traced by dynamo (our functions called inside a compiled model), it checks nothing: dynamo
    cannot trace the functorch stack query, and the graph it builds goes through the ops' registered
    autograd."""
    if torch.compiler.is_compiling():
        return
    if peek_interpreter_stack() is not None:
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        if any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters()):
            raise NotImplementedError(
                f"{name}: forward-mode AD (torch.func.jvp / jacfwd) is not supported; it has a backward "
                f"(reverse-mode) formula only")
    if forward_ad._current_level >= 0:
        for t in tensors:
            if isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None:
                raise NotImplementedError(
                    f"{name}: forward-mode AD (torch.autograd.forward_ad dual tensors) is not supported; it "
                    f"has a backward (reverse-mode) formula only")
