"""The fused ops, one module each. Importing this package registers every `torch.ops.flash.*` op.

Each module holds one op top to bottom: the plain-PyTorch reference (the CPU implementation), the kernel
launchers, the `torch.library` registration with its fake and autograd, and the public function.
"""

import importlib
import pkgutil

OP_MODULES = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))

for _name in OP_MODULES:
    importlib.import_module(f"{__name__}.{_name}")
