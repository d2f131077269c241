"""Fused Linear + bias (+ GELU), forward and backward: `torch.ops.flash.dense_gelu_*` / `dense_bias_*`.

Trade-off. The matmul is cuBLASLt's (csrc/dense_gelu.cpp); what we fuse is the memory-bound work around
it. Forward, the tanh GELU, the bias add and the store of the pre-activation (kept for backward) run in
the GEMM's epilogue (GELU_AUX_BIAS): one GEMM, no elementwise pass. Backward, the GELU derivative and the
bias gradient are one Triton pass over the (M, N) gradient (`gelu_backward_dbias`: grad_pre stored, its
column sums taken while it is in registers), then two plain GEMMs. cuBLASLt's DGELU epilogue cannot do
that pass: it applies GELU' to the GEMM's own output, and a lone Linear+GELU has no GEMM producing the
gradient of its output (that GEMM is the *next* layer's input gradient: see
`cublaslt_linear_dgrad_dgelu_bgrad`, for a future Linear-GELU-Linear). The bias gradient used to come from
the weight-gradient GEMM's BGRADB epilogue after aten.gelu_backward; that re-read grad_pre and slowed the
GEMM (bench/NOTES_dense.md), and it stays only for flash::dense_bias_bwd, which has no pass to ride in.

Exact GELU. cuBLASLt's GELU epilogues compute the tanh approximation only (checked on the H200 by
tests/test_dense.py::test_cublaslt_gelu_epilogue_is_tanh). approximate="none" is therefore never sent
through them: the GEMM writes the pre-activation and an elementwise pass computes the erf GELU
(`gelu_erf_forward`: the normal CDF by a polynomial sharing one exp, accurate to 7.5e-8; 1.26-1.31x
Inductor's GELU pass and 1.14-1.17x aten's on the H200, which spend libdevice's erf and run compute-bound);
backward uses the erf derivative. So the exact model stays exact, at the cost of one elementwise pass.

Triton path. The forward has a second implementation: a Triton matmul whose epilogue adds the bias,
computes either GELU (erf too) and stores the activation and the pre-activation
(flash_backend/kernels/linear_gelu_kernels.py). Which one runs is decided per problem by measurement, not
by guess: the first call of a (device, dtype, M rounded up to a power of 2, K, N, bias, GELU, training)
problem times the cuBLASLt forward and each Triton configuration and keeps the fastest for that key
(`forward_path_choices()` shows the decisions; inside CUDA-graph capture nothing is timed, and an
undecided problem runs cuBLASLt). That is eager calls: under torch.compile the ops' bodies are traced on
fake tensors and the forward is fixed per GELU (`_linear_gelu_cuda` says which and why).

cuBLASLt's algorithm is measured too: the first call of a GEMM problem times the heuristic's candidates,
and configurations of the same kernel family that it does not offer but that an offline search found faster
(csrc's kExtraConfigs), in interleaved rounds and keeps the fastest (csrc/dense_gelu.cpp;
`cublaslt_algo_picks()` lists the picks). The weight gradient goes through that too; the input gradient is
aten's matmul.

Paths. CUDA, fp16/bf16, K and N multiples of 8 (cuBLASLt's 16-byte alignment): cuBLASLt or Triton as
measured. Everything else (CPU, fp32, odd K/N, a failed build) runs the reference, which is plain PyTorch.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op

from flash_backend import _cpp_build
from flash_backend._device import sm_count
from flash_backend._host_math import cdiv, next_power_of_2
from flash_backend._traced_launch import traced_launch
from flash_backend.kernels.gelu_kernels import _gelu_bwd_dbias_kernel, _gelu_erf_fwd_kernel
from flash_backend.kernels.linear_gelu_kernels import _linear_gelu_fwd_kernel
from flash_backend.kernels.partial_sums import sum_partials
from flash_backend.ops._eager import needs_autograd, plain_launch
from flash_backend.ops._forward_ad import refuse_forward_ad

log = logging.getLogger("flash_backend")

__all__ = ["linear_bias_gelu", "linear_bias", "dense_gelu_reference", "dense_bias_reference"]

APPROXIMATIONS = ("none", "tanh")
_CUDA_DTYPES = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# Reference (the CPU implementation)
# --------------------------------------------------------------------------------------------------


def dense_gelu_reference(x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str = "none",
                         upcast: bool = False) -> tuple[Tensor, Tensor]:
    """(gelu(x @ weight.T + bias), x @ weight.T + bias); in fp32 when `upcast`."""
    if upcast:
        x, weight = x.float(), weight.float()
        bias = bias.float() if bias is not None else None
    pre = F.linear(x, weight, bias)
    return F.gelu(pre, approximate=approximate), pre


def dense_gelu_backward_reference(grad_out: Tensor, x: Tensor, weight: Tensor, pre: Tensor,
                                  approximate: str) -> tuple[Tensor, Tensor, Tensor]:
    grad_pre = torch.ops.aten.gelu_backward(grad_out, pre, approximate=approximate)
    return dense_bias_backward_reference(grad_pre, x, weight)


def dense_bias_reference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)


def dense_bias_backward_reference(grad_out: Tensor, x: Tensor,
                                  weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # rows spelled out, not -1: with K or N = 0 a (0-element) reshape(-1, 0) is ambiguous and raised
    rows = math.prod(x.shape[:-1])
    grad_2d = grad_out.reshape(rows, grad_out.shape[-1])
    grad_x = grad_out @ weight
    grad_weight = grad_2d.t() @ x.reshape(rows, x.shape[-1])
    return grad_x, grad_weight, grad_2d.sum(0)


# --------------------------------------------------------------------------------------------------
# Input checks: before any kernel, in the real kernels and in the fakes alike
# --------------------------------------------------------------------------------------------------


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str = "none") -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"flash dense: approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if not isinstance(t, Tensor) and not (name == "bias" and t is None):  # not an AttributeError later
            raise TypeError(f"flash dense: {name} must be a tensor, got {type(t).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"flash dense: x must be a floating-point tensor, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("flash dense: x must have at least one dimension (..., K)")
    if weight.dim() != 2:
        raise ValueError(f"flash dense: weight must be 2-D (N, K) like nn.Linear.weight, "
                         f"got {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"flash dense: weight is (N, K) = {tuple(weight.shape)} but x's last dimension is "
                         f"{x.shape[-1]}, expected K = {weight.shape[1]}")
    if weight.dtype != x.dtype:
        raise TypeError(f"flash dense: weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"flash dense: weight is on {weight.device} but x is on {x.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"flash dense: bias must have shape (N,) = ({weight.shape[0]},), "
                             f"got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"flash dense: bias dtype {bias.dtype} differs from x dtype {x.dtype}")
        if bias.device != x.device:
            raise ValueError(f"flash dense: bias is on {bias.device} but x is on {x.device}")


def _check_bwd(grad_out: Tensor, x: Tensor, weight: Tensor) -> None:
    _check(x, weight, None)
    expected = (*x.shape[:-1], weight.shape[0])
    if tuple(grad_out.shape) != expected:
        raise ValueError(f"flash dense: grad_out must have shape {expected}, got {tuple(grad_out.shape)}")
    if grad_out.dtype != x.dtype or grad_out.device != x.device:
        raise TypeError(f"flash dense: grad_out ({grad_out.dtype}, {grad_out.device}) must match x "
                        f"({x.dtype}, {x.device})")


# --------------------------------------------------------------------------------------------------
# The cuBLASLt extension (built on first CUDA use)
# --------------------------------------------------------------------------------------------------

_build_warned = False


def _extension() -> None:
    """Build/load csrc/dense_gelu.cpp (raises CppBuildError), and give its ops fakes for opcheck."""
    first = "dense_gelu" not in _cpp_build._loaded
    _cpp_build.load_extension("dense_gelu", ["dense_gelu.cpp"], libraries=("cublasLt",), header="cublasLt.h")
    if first:
        _register_cpp_fakes()


def cublaslt_ready(x: Tensor) -> bool:
    """Whether the cuBLASLt ops can take x's device and dtype (building csrc on first use).

    Also what other ops that call the csrc GEMMs (linear_cross_entropy) ask before using them.
    """
    global _build_warned
    if not (x.is_cuda and x.dtype in _CUDA_DTYPES):
        return False
    try:
        _extension()
    except _cpp_build.CppBuildError as e:
        if not _build_warned:
            warnings.warn(f"{e}\nflash: falling back to the PyTorch reference", stacklevel=3)
            _build_warned = True
        return False
    return True


def cublaslt_algo_picks() -> list[str]:
    """One line per GEMM problem csrc timed its cuBLASLt candidates for in this process: the problem's key
    (device/dtype/transposes/MxNxK/leading dims/epilogue/alignments), the candidate it kept, and each
    candidate's time (the median of its interleaved rounds). Empty where csrc was never built or used."""
    if "dense_gelu" not in _cpp_build._loaded:
        return []
    return list(torch.ops.flash.cublaslt_algo_picks())


def _cublaslt_ok(x: Tensor, weight: Tensor) -> bool:
    # K or N = 0 passes `% 8 == 0` but is nothing to gain: the reference gives F.linear's answer (and _as_2d
    # cannot infer the rows of an empty (..., 0) tensor)
    return (x.shape[-1] % 8 == 0 and weight.shape[0] % 8 == 0 and x.shape[-1] > 0 and weight.shape[0] > 0
            and cublaslt_ready(x))


def _register_cpp_fakes() -> None:
    @torch.library.register_fake("flash::cublaslt_linear_gelu_tanh")
    def _(x, weight, bias, store_pre):
        out = x.new_empty(x.shape[0], weight.shape[0])
        return out, x.new_empty(out.shape if store_pre else (0,))

    @torch.library.register_fake("flash::cublaslt_linear")
    def _(x, weight, bias):
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("flash::cublaslt_linear_wgrad_bgrad")
    def _(grad, x):
        return x.new_empty(grad.shape[1], x.shape[1]), x.new_empty(grad.shape[1])

    @torch.library.register_fake("flash::cublaslt_linear_wgrad")
    def _(grad, x):
        return x.new_empty(grad.shape[1], x.shape[1])

    @torch.library.register_fake("flash::cublaslt_linear_dgrad_dgelu_bgrad")
    def _(grad, weight, pre):
        return pre.new_empty(pre.shape), pre.new_empty(pre.shape[1])


def _as_2d(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


# --------------------------------------------------------------------------------------------------
# The forward's two implementations, and the per-problem choice between them
# --------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): the candidates every problem times. H200
# (bench/results/dense_forward_paths.json): 128 x 128 with 4 warps beat 128 x 256 with 8 only at M=8192,
# (K, N) = (3072, 768), where both lost to cuBLASLt by 20-30 %; so only the latter is timed (each candidate
# costs a Triton compile at a problem's first call).
TRITON_CONFIGS = ((128, 256, 64, 8, 8, 3),)


def triton_linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str, store_pre: bool,
                       config: tuple = TRITON_CONFIGS[0], launch=plain_launch) -> tuple[Tensor, Tensor]:
    """(gelu(x @ weight.T + bias), the pre-activation or an empty tensor) for 2-D x: the Triton kernel.
    `launch` wraps the kernel (traced_launch inside the ops)."""
    rows, k = x.shape
    n = weight.shape[0]
    out = x.new_empty(rows, n)
    pre = x.new_empty(rows, n) if store_pre else x.new_empty(0)
    if rows == 0:
        return out, pre
    block_m, block_n, block_k, group_m, warps, stages = config
    grid = (cdiv(rows, block_m) * cdiv(n, block_n),)
    launch(_linear_gelu_fwd_kernel)[grid](
        x, weight, bias if bias is not None else out, out, pre if store_pre else out, rows, n, x.stride(0),
        weight.stride(0), K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        HAS_BIAS=bias is not None, APPROXIMATE_TANH=approximate == "tanh", STORE_PRE=store_pre,
        num_warps=warps, num_stages=stages)
    return out, pre


def _cublaslt_linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str,
                          store_pre: bool) -> tuple[Tensor, Tensor]:
    if approximate == "tanh":
        return torch.ops.flash.cublaslt_linear_gelu_tanh(x, weight, bias, store_pre)
    return _erf_gelu_after(torch.ops.flash.cublaslt_linear(x, weight, bias), store_pre)


# --------------------------------------------------------------------------------------------------
# The erf GELU's forward pass (flash_backend/kernels/gelu_kernels.py)
# --------------------------------------------------------------------------------------------------

# (BLOCK, num_warps, erf GELU's CDF by polynomial) of the forward pass. H200 (bench_dense.py --gelu-forward,
# bench/logs/dense_gelu_forward_h200.log, 5 shapes from 8192 x 3072 to 16384 x 6400, bf16): 2048 x 4 warps
# 1.26-1.31x Inductor's GELU pass, 3.2-3.6 TB/s against a copy's 3.8-4.2; 4096 x 8 1.24-1.26x, 1024 x 4 and
# 2048 x 8 1.20-1.22x; libdevice's erf at 2048 x 8 1.01x (it is the erf, not the launch).
GELU_FWD_CONFIG = (2048, 4, True)


def gelu_erf_forward(pre: Tensor, out: Tensor | None = None, config: tuple = GELU_FWD_CONFIG,
                     launch=plain_launch) -> Tensor:
    """F.gelu(pre) (erf) for a contiguous pre, into `out` (a new tensor if None; pre itself works: in
    place). `launch` wraps the kernel (traced_launch inside the ops' bodies)."""
    out = torch.empty_like(pre) if out is None else out
    numel = pre.numel()
    if numel:
        block, warps, poly_cdf = config
        launch(_gelu_erf_fwd_kernel)[(cdiv(numel, block),)](
            pre, out, numel, BLOCK=block, POLY_CDF=poly_cdf, num_warps=warps)
    return out


def _erf_gelu_after(pre: Tensor, store_pre: bool) -> tuple[Tensor, Tensor]:
    """(gelu(pre), pre or an empty tensor) for a GEMM's output pre: the erf forward's second half, in place
    when the pre-activation is not kept."""
    if store_pre:
        return gelu_erf_forward(pre, launch=traced_launch), pre
    return gelu_erf_forward(pre, out=pre, launch=traced_launch), pre.new_empty(0)


# --------------------------------------------------------------------------------------------------
# The GELU backward pass (flash_backend/kernels/gelu_kernels.py)
# --------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, programs per SM, loop stages, erf GELU's CDF by polynomial) of the GELU' +
# bias-gradient pass, per GELU. The pass is memory-bound: a program keeps 2 x BLOCK_M x BLOCK_N elements in
# flight (times the stages), and the grid asks for enough row chunks to fill every SM a few times over while
# each program walks many rows (fewer partial sums). Session 10's sweep over 5 (M, N) and both GELUs
# (bench/logs/dense_gelu_backward_h200.log) picked 32x128 / 4 warps / 8 per SM / 2 stages for both: 1.23x
# aten.gelu_backward + sum(0) in geometric mean. A wider sweep at N = 3072 (24 configs, M = 8192-16384,
# bench/logs/dense_gelu_backward_sweep_h200.log, ..._sweep2_h200.log) splits them: tanh's GELU' is cheap
# and runs best on 16x128 tiles, 8 programs per SM (84.2 vs 89.5 us at 16384 x 3072, 46.2 vs 49.1 at
# 8192 x 3072); erf's polynomial CDF on 8-row tiles of 256 columns, 2 warps, 3 stages (85.7 vs 93.0 us).
# The fp32 column-sum tile costs registers: 62 a thread at 16x128 / 4 warps (32 without it), so 8 programs
# fit an SM where 16 were asked for, and the pass runs ~4 us slower than without the sums.
GELU_BWD_CONFIGS = {"tanh": (16, 128, 4, 8, 2, True), "none": (8, 256, 2, 16, 3, True)}


def _row_chunks(device: torch.device, m: int, col_blocks: int, block_m: int, per_sm: int) -> int:
    """Rows per program of the backward pass: every program gets the same multiple of block_m rows."""
    sms = sm_count(device) if device.type == "cuda" else 2
    chunks = max(1, per_sm * sms // col_blocks)
    return cdiv(cdiv(m, chunks), block_m) * block_m


def gelu_backward_dbias(grad_out: Tensor, pre: Tensor, approximate: str, with_dbias: bool = True,
                        config: tuple | None = None, launch=plain_launch) -> tuple[Tensor, Tensor | None]:
    """(grad_out * gelu'(pre), its column sums or None) for contiguous 2-D (M, N) tensors, in one pass.

    The column sums (the bias gradient) accumulate in fp32 per row chunk and are summed by one more launch
    (kernels/partial_sums.py); they are returned in pre's dtype, as eager's `grad_pre.sum(0)`. `launch`
    wraps the kernels (traced_launch inside the ops' bodies). `config` overrides GELU_BWD_CONFIGS."""
    m, n = pre.shape
    block_m, block_n, warps, per_sm, stages, poly_cdf = config or GELU_BWD_CONFIGS[approximate]
    block_n = min(block_n, next_power_of_2(n))
    if block_m * n >= 2**31:  # the kernel's in-tile offsets are int32
        grad_pre = torch.ops.aten.gelu_backward(grad_out, pre, approximate=approximate)
        return grad_pre, (grad_pre.sum(0) if with_dbias else None)
    grad_pre = torch.empty_like(pre)
    if m == 0 or n == 0:
        return grad_pre, (pre.new_zeros(n) if with_dbias else None)
    col_blocks = cdiv(n, block_n)
    rows_per_program = _row_chunks(pre.device, m, col_blocks, block_m, per_sm)
    chunks = cdiv(m, rows_per_program)
    partial = pre.new_empty((chunks, n) if with_dbias else (0,), dtype=torch.float32)
    launch(_gelu_bwd_dbias_kernel)[(chunks, col_blocks)](
        grad_out, pre, grad_pre, partial, m, n, rows_per_program, BLOCK_M=block_m, BLOCK_N=block_n,
        APPROXIMATE_TANH=approximate == "tanh", STORE_DBIAS=with_dbias, STAGES=stages,
        POLY_CDF=poly_cdf, num_warps=warps)
    if not with_dbias:
        return grad_pre, None
    grad_bias = pre.new_empty(n)
    sum_partials(None, None, partial, grad_bias, launch)  # one launch: sum and cast
    return grad_pre, grad_bias


_forward_choice: dict[tuple, str] = {}


def forward_path_choices() -> dict[tuple, str]:
    """The measured choice per problem:
    {(device, dtype, M bucket, K, N, bias, approximate, training): implementation name}."""
    return dict(_forward_choice)


def _time_ms(fn, reps: int = 10) -> float:
    """GPU milliseconds per call of fn. The timed calls are queued behind a ~1 ms sleep kernel, so the events
    bracket GPU work alone: timed back to back from Python, a ~70 us GEMM measured its launch overhead, and
    bench_dense.py's H200 run at e5b311c kept the slower Triton forward at M=8192, K=768, N=3072 (435
    against cuBLASLt's ~560 TFLOP/s)."""
    fn()  # warm-up (and, for Triton, the compile)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sleep = getattr(torch.cuda, "_sleep", None)  # private: a torch without it times from Python, as before
    if sleep is not None:
        sleep(2_000_000)  # ~1 ms of GPU clock cycles: the host queues the reps meanwhile
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / reps


def _forward_implementations() -> dict:
    """name -> fn(x, weight, bias, approximate, store_pre): what each problem's first call times. The Triton
    kernels go through traced_launch, as the ops' bodies need (it launches directly outside tracing)."""
    impls = {"cublaslt": _cublaslt_linear_gelu}
    for config in TRITON_CONFIGS:
        impls["triton" + "x".join(map(str, config))] = functools.partial(triton_linear_gelu, config=config,
                                                                          launch=traced_launch)
    return impls


_FORWARDS = _forward_implementations()


def _linear_gelu_cuda(x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str,
                      store_pre: bool) -> tuple[Tensor, Tensor]:
    """The forward on CUDA (x 2-D, all contiguous) by whichever implementation measured fastest here.

    Traced (torch.compile sees inside the ops: fake tensors, nothing to time; and a compiled graph should not
    depend on which eager calls happened to run before it) the choice is fixed:
    - tanh GELU: cuBLASLt's GELU_AUX_BIAS epilogue, one GEMM and no pass (the H200 picked cuBLASLt for every
      (768, 3072) problem once the timing bracketed GPU work only, bench/NOTES_dense.md);
    - erf GELU: F.linear (Inductor's addmm) then our erf GELU pass (`gelu_erf_forward`, 1.26-1.31x
      Inductor's own GELU pass: bench/results/dense_gelu_forward.json). cuBLASLt's BIAS epilogue in place of
      the addmm measured slower in ViT-base's step (M = 12608): 22.4 ms against 20.3 without the rewrite
      (bench/logs/e2e_dense_default_h200.log, 386618f)."""
    args = (x, weight, bias, approximate, store_pre)
    if is_fake(x):
        if approximate == "none":
            return _erf_gelu_after(F.linear(x, weight, bias), store_pre)
        return _FORWARDS["cublaslt"](*args)
    key = (x.device.index, x.dtype, next_power_of_2(max(1, x.shape[0])), x.shape[1], weight.shape[0],
           bias is not None, approximate, store_pre)
    name = _forward_choice.get(key)
    if name is None:
        if torch.cuda.is_current_stream_capturing():
            return _FORWARDS["cublaslt"](*args)  # nothing is timed during capture; not decided either
        times = {n: _time_ms(lambda fn=fn: fn(*args)) for n, fn in _FORWARDS.items()}
        name = min(times, key=times.get)
        _forward_choice[key] = name
        log.info("flash dense: %s for M~%d K=%d N=%d %s%s (ms: %s)", name, key[2], key[3], key[4],
                 approximate, " training" if store_pre else "",
                 ", ".join(f"{n} {t:.4f}" for n, t in times.items()))
    return _FORWARDS[name](*args)


def _cuda_wgrad_bgrad(grad_pre_2d: Tensor, x: Tensor, weight: Tensor,
                      x_shape) -> tuple[Tensor, Tensor, Tensor]:
    grad_x = (grad_pre_2d @ weight).view(*x_shape)
    grad_weight, grad_bias = torch.ops.flash.cublaslt_linear_wgrad_bgrad(grad_pre_2d, _as_2d(x))
    return grad_x, grad_weight, grad_bias


# --------------------------------------------------------------------------------------------------
# The ops: flash::dense_gelu_fwd / _bwd, flash::dense_bias_fwd / _bwd
#
# triton_op, not custom_op: under torch.compile the body is traced into the graph, so Inductor launches the
# Triton pass from its generated code and calls the csrc GEMMs as extern kernels. As opaque custom ops every
# call went through custom_op's Python dispatch (~0.24 ms of host time a call under cProfile in BERT's
# step, 26 calls a step: bench/logs/profile_e2e_bert_dense_h200.log), which made the rewrite's GPU saving
# depend on the host. Each body handles every device: the reference wherever cuBLASLt cannot run (CPU,
# fp32, odd K/N, a failed build), and the CPU never builds csrc (_cublaslt_ok asks is_cuda first).
# --------------------------------------------------------------------------------------------------


@triton_op("flash::dense_gelu_fwd", mutates_args=())
def dense_gelu_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str) -> tuple[Tensor, Tensor]:
    """x (..., K), weight (N, K), bias (N,) or None -> (gelu(pre), pre), both (..., N) and contiguous."""
    _check(x, weight, bias, approximate)
    if not _cublaslt_ok(x, weight):
        out, pre = dense_gelu_reference(x, weight, bias, approximate)
        return out.contiguous(), pre.contiguous()
    shape = (*x.shape[:-1], weight.shape[0])
    bias = bias.contiguous() if bias is not None else None
    out, pre = _linear_gelu_cuda(_as_2d(x), weight.contiguous(), bias, approximate, store_pre=True)
    return out.view(shape), pre.view(shape)


@dense_gelu_fwd.register_fake
def _(x, weight, bias, approximate):
    _check(x, weight, bias, approximate)
    shape = (*x.shape[:-1], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


@triton_op("flash::dense_gelu_inference", mutates_args=())
def dense_gelu_inference(x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str) -> Tensor:
    """dense_gelu_fwd without the pre-activation, for inference: no (M, N) store of it, no autograd."""
    _check(x, weight, bias, approximate)
    if not _cublaslt_ok(x, weight):
        return dense_gelu_reference(x, weight, bias, approximate)[0].contiguous()
    bias = bias.contiguous() if bias is not None else None
    out, _ = _linear_gelu_cuda(_as_2d(x), weight.contiguous(), bias, approximate, store_pre=False)
    return out.view(*x.shape[:-1], weight.shape[0])


@dense_gelu_inference.register_fake
def _(x, weight, bias, approximate):
    _check(x, weight, bias, approximate)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@triton_op("flash::dense_gelu_bwd", mutates_args=())
def dense_gelu_bwd(grad_out: Tensor, x: Tensor, weight: Tensor, pre: Tensor,
                   approximate: str) -> tuple[Tensor, Tensor, Tensor]:
    """-> (grad_x (..., K), grad_weight (N, K), grad_bias (N,)), all contiguous."""
    _check_bwd(grad_out, x, weight)
    if not _cublaslt_ok(x, weight):
        grads = dense_gelu_backward_reference(grad_out, x, weight, pre, approximate)
        return tuple(g.contiguous() for g in grads)
    grad_pre, grad_bias = gelu_backward_dbias(_as_2d(grad_out), _as_2d(pre), approximate,
                                              launch=traced_launch)
    grad_x = (grad_pre @ weight).view(x.shape)
    # The weight gradient through csrc, whose candidates (kExtraConfigs) beat aten's `grad_pre.t() @ x` by
    # 2-10 % at bench_dense's shapes; the input gradient stays aten's (no faster candidate was found).
    return grad_x, torch.ops.flash.cublaslt_linear_wgrad(grad_pre, _as_2d(x)), grad_bias


@dense_gelu_bwd.register_fake
def _(grad_out, x, weight, pre, approximate):
    _check_bwd(grad_out, x, weight)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[0])


@triton_op("flash::dense_bias_fwd", mutates_args=())
def dense_bias_fwd(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., K), weight (N, K), bias (N,) or None -> x @ weight.T + bias, (..., N) contiguous."""
    _check(x, weight, bias)
    if not _cublaslt_ok(x, weight):
        return dense_bias_reference(x, weight, bias).contiguous()
    bias = bias.contiguous() if bias is not None else None
    out = torch.ops.flash.cublaslt_linear(_as_2d(x), weight.contiguous(), bias)
    return out.view(*x.shape[:-1], weight.shape[0])


@dense_bias_fwd.register_fake
def _(x, weight, bias):
    _check(x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@triton_op("flash::dense_bias_bwd", mutates_args=())
def dense_bias_bwd(grad_out: Tensor, x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """-> (grad_x (..., K), grad_weight (N, K), grad_bias (N,)), all contiguous."""
    _check_bwd(grad_out, x, weight)
    if not _cublaslt_ok(x, weight):
        return tuple(g.contiguous() for g in dense_bias_backward_reference(grad_out, x, weight))
    return _cuda_wgrad_bgrad(_as_2d(grad_out), x, weight.contiguous(), x.shape)


@dense_bias_bwd.register_fake
def _(grad_out, x, weight):
    _check_bwd(grad_out, x, weight)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[0])


# --------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------


def _setup_gelu(ctx, inputs, output):
    x, weight, bias, approximate = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.approximate = approximate
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1])
    # pre is returned only to be saved; autograd would hand its (non-)gradient to the backward as an (M, N)
    # zeros tensor, a fill kernel the backward never reads (30.6 us of a 496 us step at M = 16384, N = 3072
    # on the H200, bench/logs/profile_dense_steps_h200.log).
    ctx.set_materialize_grads(False)


def _backward_gelu(ctx, grad_out, _grad_pre):
    if grad_out is None:  # the activation does not reach the loss: every input gradient is zero
        return None, None, None, None
    x, weight, pre = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = torch.ops.flash.dense_gelu_bwd(grad_out, x, weight, pre, ctx.approximate)
    return grad_x, grad_weight, grad_bias if ctx.has_bias else None, None


torch.library.register_autograd("flash::dense_gelu_fwd", _backward_gelu, setup_context=_setup_gelu)


def _setup_bias(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward_bias(ctx, grad_out):
    x, weight = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = torch.ops.flash.dense_bias_bwd(grad_out, x, weight)
    return grad_x, grad_weight, grad_bias if ctx.has_bias else None


torch.library.register_autograd("flash::dense_bias_fwd", _backward_bias, setup_context=_setup_bias)


# --------------------------------------------------------------------------------------------------
# Public functions (what the fx_passes rewrite emits)
# --------------------------------------------------------------------------------------------------


def linear_bias_gelu(x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str = "none") -> Tensor:
    """F.gelu(F.linear(x, weight, bias), approximate=approximate), fused. weight is (N, K) like nn.Linear."""
    _check(x, weight, bias, approximate)
    refuse_forward_ad("linear_bias_gelu", x, weight, bias)
    if needs_autograd(x, weight, bias):
        return torch.ops.flash.dense_gelu_fwd(x, weight, bias, approximate)[0]
    return torch.ops.flash.dense_gelu_inference(x, weight, bias, approximate)


def linear_bias(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear(x, weight, bias), with the bias gradient fused into the weight-gradient GEMM."""
    _check(x, weight, bias)
    refuse_forward_ad("linear_bias", x, weight, bias)
    return torch.ops.flash.dense_bias_fwd(x, weight, bias)
