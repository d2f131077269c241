"""JIT build of the CUDA C++ extensions in csrc/, on first use, with ninja (torch.utils.cpp_extension.load).

Builds are cached in torch's extensions directory (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions),
so only the first process on a machine pays the compile. Callers ask only where CUDA is available: a
machine without a GPU never builds, even if it has nvcc. A failed build raises CppBuildError carrying the
compiler's message, and is not retried in the same process.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent.parent / "csrc"

_loaded: dict[str, object] = {}
_failed: dict[str, str] = {}


class CppBuildError(RuntimeError):
    pass


def _cuda_library_dirs(header: str) -> tuple[list[str], list[str]]:
    """Include and library dirs for a CUDA library header (e.g. cublasLt.h) the toolkit may lack.

    A toolkit installed with nvcc alone has no cuBLAS headers; the pip wheels torch depends on
    (nvidia-cublas, ...) carry them, next to the very .so files torch itself loads.
    """
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "include", header)):
        return [], []
    includes, libs = [], []
    for site in sys.path:
        for hit in glob.glob(os.path.join(site, "nvidia", "**", "include", header), recursive=True):
            root = os.path.dirname(os.path.dirname(hit))
            includes.append(os.path.dirname(hit))
            libs += [d for d in (os.path.join(root, "lib"), os.path.join(root, "lib64")) if os.path.isdir(d)]
    return sorted(set(includes)), sorted(set(libs))


def _link_flags(libraries: tuple[str, ...], lib_dirs: list[str]) -> list[str]:
    """-L/-l flags; pip wheels ship only versioned .so files (libcublasLt.so.13), linked as -l:<file>."""
    from torch.utils.cpp_extension import CUDA_HOME

    search = list(lib_dirs)
    if CUDA_HOME:
        search += [os.path.join(CUDA_HOME, "lib64"), os.path.join(CUDA_HOME, "lib")]
    flags = [f"-L{d}" for d in lib_dirs] + [f"-Wl,-rpath,{d}" for d in lib_dirs]
    for lib in libraries:
        versioned = [f for d in search for f in sorted(glob.glob(os.path.join(d, f"lib{lib}.so.*")))]
        if any(os.path.exists(os.path.join(d, f"lib{lib}.so")) for d in search) or not versioned:
            flags.append(f"-l{lib}")
        else:
            flags += [f"-L{os.path.dirname(versioned[0])}", f"-l:{os.path.basename(versioned[0])}"]
    return flags


def load_extension(name: str, sources: list[str], *, libraries: tuple[str, ...] = (),
                   header: str | None = None):
    """Build (or load from cache) csrc/<sources> as `name`; its TORCH_LIBRARY ops register on load."""
    if name in _loaded:
        return _loaded[name]
    if name in _failed:
        raise CppBuildError(_failed[name])
    if not torch.cuda.is_available():
        raise CppBuildError(f"{name}: CUDA is not available, the CUDA C++ extension is not built")
    from torch.utils.cpp_extension import load

    includes, lib_dirs = _cuda_library_dirs(header) if header else ([], [])
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}" + ("a" if major == 9 else "")
    ldflags = _link_flags(libraries, lib_dirs)
    try:
        module = load(
            name=name,
            sources=[str(CSRC / s) for s in sources],
            extra_include_paths=includes,
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
            extra_ldflags=ldflags,
            with_cuda=True,
            is_python_module=False,
            verbose=os.environ.get("FLASH_BUILD_VERBOSE") == "1",
        )
    except Exception as e:  # the compiler's output is in the message; keep it whole
        _failed[name] = (
            f"building the CUDA extension {name!r} from csrc/{', '.join(sources)} failed "
            f"(set FLASH_BUILD_VERBOSE=1 for the full command): {e}"
        )
        raise CppBuildError(_failed[name]) from e
    _loaded[name] = module
    return module
