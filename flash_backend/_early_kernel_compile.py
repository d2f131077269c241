"""Compile-time overlap: our Triton kernels start compiling when Inductor writes them, not when it loads them.

Why: under torch.compile our CUDA ops are `triton_op`s, so Inductor's generated module defines our kernels
as user-defined Triton kernels: `name = async_compile.triton('name', '''<source>''')` in the module's
header. Inductor's own kernels are handed to its compile worker pool the moment they are generated, so
their compiles overlap the rest of code generation; a user-defined kernel is only submitted when the
finished module is loaded, and the load then waits for the slowest one. Ours are the largest kernels of a
step: in BERT-base's first step the attention backward took 2.55 s to compile and the forward 1.25 s
(bench/logs/first_step_bert_flash_threads1_h200.log), and the module load waited 4.3 s against Inductor's
0.8 s (bench/logs/first_step_bert_flash_h200.log).

What this does: when Inductor's wrapper codegen defines one of our kernels, the definition it emits is
read back (the module text it will become, through Inductor's own IndentedBuffer.splice), and the same
`async_compile.triton(name, source)` call is made right away. AsyncCompile keeps the future keyed by the
source text, so the module's own call at load time finds it: the compile ran while Inductor generated the
rest of the graph. The source is taken verbatim from the emitted definition, never rebuilt, so a hit is
exactly the kernel the module asked for; anything that does not parse as that one call is left to the
load as before (a miss costs nothing but the early submission).

Only when Inductor's process pool is up (as for its own kernels), only for kernels defined in
flash_backend. Installed by the `flash` backend before it compiles; a torch without these internals
(private API) gets no early compile. `FLASH_BACKEND_EARLY_KERNEL_COMPILE=0` turns it off.
"""

from __future__ import annotations

import ast
import collections
import functools
import logging

from flash_backend import config as flash_config
from flash_backend._ttir_memo import _is_our_kernel

log = logging.getLogger("flash_backend")

submitted: collections.Counter = collections.Counter()  # kernel name -> early submissions (tests read it)


def emitted_compile_call(definition: str) -> tuple[str, str, str] | None:
    """(kernel name, source, device_str) of the `async_compile.triton(...)` call in a kernel definition
    emitted by Inductor's wrapper codegen, as the generated module will hold it; None if it is not exactly
    one such call with literal arguments."""
    from torch._inductor.utils import IndentedBuffer

    # The definition reaches the module through IndentedBuffer.splice (the header), which dedents it and
    # empties whitespace-only lines: the string literal in the module is the one in this text.
    module_text = IndentedBuffer()
    module_text.splice(definition)
    try:
        tree = ast.parse(module_text.getvalue())
    except SyntaxError:
        return None
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "triton"
             and isinstance(node.func.value, ast.Name) and node.func.value.id == "async_compile"]
    if len(calls) != 1:
        return None
    call = calls[0]
    literals = [arg.value for arg in call.args
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
    keywords = {kw.arg: kw.value.value for kw in call.keywords if isinstance(kw.value, ast.Constant)}
    if len(literals) != len(call.args) or len(literals) not in (2, 3) or set(keywords) - {"device_str"}:
        return None
    name, source, *device = literals
    return name, source, (device[0] if device else keywords.get("device_str", "cuda"))


def _submit(definition: str) -> bool:
    from torch._inductor.async_compile import AsyncCompile

    call = emitted_compile_call(definition)
    if call is None:
        log.debug("flash early compile: a kernel definition was not one async_compile.triton call; left to "
                  "the module load")
        return False
    name, source, device_str = call
    AsyncCompile().triton(name, source, device_str=device_str)
    submitted[name] += 1
    log.debug("flash early compile: %s submitted at codegen", name)
    return True


def _early(define_user_defined_triton_kernel):
    @functools.wraps(define_user_defined_triton_kernel)
    def define(self, kernel, *args, **kwargs):
        from torch._inductor.async_compile import AsyncCompile

        if not (flash_config.early_kernel_compile and _is_our_kernel(kernel)
                and AsyncCompile.use_process_pool()):
            return define_user_defined_triton_kernel(self, kernel, *args, **kwargs)
        definitions = []
        define_kernel = self.define_kernel

        def keep(name, body, *rest, **kw):
            definitions.append(body)
            return define_kernel(name, body, *rest, **kw)

        self.define_kernel = keep  # an instance attribute: shadows the method for this one call
        try:
            result = define_user_defined_triton_kernel(self, kernel, *args, **kwargs)
        finally:
            del self.define_kernel
        for body in definitions:  # none when the wrapper had already defined this specialisation
            try:
                _submit(body)
            except Exception as e:  # noqa: BLE001 - an optimisation: the module load compiles it anyway
                log.debug("flash early compile: submission failed (%s: %s); left to the module load",
                          type(e).__name__, e)
        return result

    define._flash_early = True
    return define


def install() -> bool:
    """Wrap Inductor's user-defined-kernel codegen (idempotent). False when this torch lacks it."""
    try:
        from torch._inductor.codegen.wrapper import PythonWrapperCodegen
        from torch._inductor.utils import IndentedBuffer  # noqa: F401 - emitted_compile_call needs it
    except ImportError:
        return False
    current = getattr(PythonWrapperCodegen, "define_user_defined_triton_kernel", None)
    if current is None:
        log.debug("torch's wrapper codegen has no define_user_defined_triton_kernel: no early compile")
        return False
    if not getattr(current, "_flash_early", False):
        PythonWrapperCodegen.define_user_defined_triton_kernel = _early(current)
    return True
