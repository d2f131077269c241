"""flash::dense_gelu_* / dense_bias_*: reference, op contract, autograd, errors; cuBLASLt on the GPU."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

from flash_backend.ops import dense
from flash_backend.ops.dense import dense_gelu_reference, linear_bias, linear_bias_gelu

APPROX = ["none", "tanh"]


def _inputs(shape, n, dtype=torch.float32, device="cpu", bias=True, requires_grad=False):
    k = shape[-1]
    x = torch.randn(*shape, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    for t in (x, w, b):
        if t is not None:
            t.requires_grad_(requires_grad)
    return x, w, b


def _grads(fn, x, w, b, grad):
    out = fn(x, w, b)
    leaves = [t for t in (x, w, b) if t is not None]
    return [out.detach()] + [g.detach() for g in torch.autograd.grad(out, leaves, grad)]


# ---------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_fp64(approximate, dtype):
    x, w, b = _inputs((97, 48), 40, dtype)
    out, pre = dense_gelu_reference(x, w, b, approximate)
    out64, pre64 = dense_gelu_reference(x.double(), w.double(), b.double(), approximate)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), out64, atol=tol, rtol=tol)
    torch.testing.assert_close(pre.double(), pre64, atol=tol, rtol=tol)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(37, 24), (3, 7, 24)])
def test_autograd_matches_torch(approximate, bias, shape):
    x, w, b = _inputs(shape, 16, torch.float64, bias=bias, requires_grad=True)
    grad = torch.randn(*shape[:-1], 16, dtype=torch.float64)
    ours = _grads(lambda x, w, b: linear_bias_gelu(x, w, b, approximate), x, w, b, grad)
    ref = _grads(lambda x, w, b: F.gelu(F.linear(x, w, b), approximate=approximate), x, w, b, grad)
    for a, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, r)
    ours = _grads(linear_bias, x, w, b, grad)
    ref = _grads(F.linear, x, w, b, grad)
    for a, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, r)


def test_gradcheck():
    x, w, b = _inputs((5, 8), 6, torch.float64, requires_grad=True)
    for approximate in APPROX:
        assert torch.autograd.gradcheck(lambda *t, a=approximate: linear_bias_gelu(*t, a), (x, w, b))
    assert torch.autograd.gradcheck(linear_bias, (x, w, b))


def test_backward_gets_no_zero_filled_grad_for_pre():
    # dense_gelu_fwd returns pre only to save it for backward. Its (non-)gradient must reach the backward as
    # None, not as an (M, N) zeros tensor that a fill kernel writes and nothing reads (30.6 us of a 496 us
    # step at M = 16384, N = 3072 on the H200). A dispatch mode sees every op the backward runs.
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    x, w, b = _inputs((37, 24), 16, torch.float64, requires_grad=True)
    grad = torch.randn(37, 16, dtype=torch.float64)
    out = linear_bias_gelu(x, w, b, "tanh")
    with Log():
        got = torch.autograd.grad(out, (x, w, b), grad)
    expected = torch.autograd.grad(F.gelu(F.linear(x, w, b), approximate="tanh"), (x, w, b), grad)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    assert torch.ops.flash.dense_gelu_bwd.default in calls
    fills = [f for f in calls if f in (torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default,
                                       torch.ops.aten.full.default, torch.ops.aten.fill_.Scalar,
                                       torch.ops.aten.zero_.default)]
    assert not fills, fills


def _opcheck_all(device, dtype):
    x, w, b = _inputs((2, 9, 16), 24, dtype, device, requires_grad=True)
    x_t = torch.randn(16, 18, dtype=dtype, device=device).t().requires_grad_()  # non-contiguous x
    g = torch.randn(2, 9, 24, dtype=dtype, device=device)
    pre = torch.randn(2, 9, 24, dtype=dtype, device=device)
    for approximate in APPROX:
        opcheck(torch.ops.flash.dense_gelu_fwd, (x, w, b, approximate))
        opcheck(torch.ops.flash.dense_gelu_fwd, (x_t, w, None, approximate))
        opcheck(torch.ops.flash.dense_gelu_bwd, (g, x.detach(), w.detach(), pre, approximate))
        opcheck(torch.ops.flash.dense_gelu_inference, (x.detach(), w.detach(), b.detach(), approximate))
        opcheck(torch.ops.flash.dense_gelu_inference, (x_t.detach(), w.detach(), None, approximate))
    opcheck(torch.ops.flash.dense_bias_fwd, (x, w, b))
    opcheck(torch.ops.flash.dense_bias_fwd, (x_t, w, None))
    opcheck(torch.ops.flash.dense_bias_bwd, (g, x.detach(), w.detach()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_cpu(dtype):
    _opcheck_all("cpu", dtype)


def test_fake_mirrors_real_allocation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w, b = _inputs((3, 5, 16), 24)
    real = torch.ops.flash.dense_gelu_fwd(x, w, b, "none")
    with FakeTensorMode() as mode:
        fx, fw, fb = (mode.from_tensor(t) for t in (x, w, b))
        fake = torch.ops.flash.dense_gelu_fwd(fx, fw, fb, "none")
    for r, f in zip(real, fake, strict=True):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


def test_errors_name_the_argument():
    x, w, b = _inputs((4, 16), 8)
    with pytest.raises(ValueError, match="approximate"):
        linear_bias_gelu(x, w, b, approximate="sigmoid")
    with pytest.raises(ValueError, match="K = 16"):
        linear_bias_gelu(x[:, :15], w, b)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        linear_bias_gelu(x, w[0], b)
    with pytest.raises(ValueError, match="bias must have shape"):
        linear_bias(x, w, b[:4])
    with pytest.raises(TypeError, match="weight dtype"):
        linear_bias_gelu(x, w.double(), b)
    with pytest.raises(TypeError, match="bias dtype"):
        linear_bias(x, w, b.half())
    with pytest.raises(TypeError, match="floating-point"):
        linear_bias(x.long(), w, b)
    with pytest.raises(ValueError, match="grad_out"):
        torch.ops.flash.dense_gelu_bwd(torch.randn(4, 9), x, w, torch.randn(4, 8), "none")


def test_cpu_never_builds(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("tried to build the CUDA extension")

    monkeypatch.setattr(dense._cpp_build, "load_extension", boom)
    x, w, b = _inputs((4, 16), 8)
    linear_bias_gelu(x, w, b, "tanh")
    linear_bias(x, w, b)


def test_compiled_graph_traces_a_fixed_forward_and_times_nothing(monkeypatch):
    """Under torch.compile the ops' bodies are traced (triton_op) with fake tensors: the forward must take
    its fixed traced path there (cuBLASLt for tanh, F.linear + our erf GELU pass for erf), never time
    implementations on fake tensors, and the traced graph must compute what eager does. The CPU stands in
    for CUDA: cuBLASLt is reported available and replaced by the reference, the GELU pass by F.gelu (the
    interpreter cannot launch on fake tensors; the pass itself is tested below)."""
    calls = []

    def cublaslt_stand_in(x, weight, bias, approximate, store_pre, launch=None):
        calls.append(("cublaslt", dense.is_fake(x)))
        out, pre = dense_gelu_reference(x, weight, bias, approximate)
        return out, (pre if store_pre else x.new_empty(0))

    def gelu_pass_stand_in(pre, out=None, launch=None):
        calls.append(("gelu_pass", dense.is_fake(pre)))
        return F.gelu(pre)

    def no_timing(*args, **kwargs):
        raise AssertionError("timed an implementation while tracing")

    monkeypatch.setattr(dense, "_cublaslt_ok", lambda x, weight: True)
    monkeypatch.setattr(dense, "_FORWARDS", {"cublaslt": cublaslt_stand_in, "triton": no_timing})
    monkeypatch.setattr(dense, "gelu_erf_forward", gelu_pass_stand_in)
    monkeypatch.setattr(dense, "_time_ms", no_timing)
    x, w, b = _inputs((3, 5, 16), 24)
    for approximate in ("tanh", "none"):
        calls.clear()
        fn = lambda x, w, b, approximate=approximate: torch.ops.flash.dense_gelu_fwd(x, w, b, approximate)
        torch._dynamo.reset()
        got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x, w, b)
        # traced with fake tensors only; tanh through cuBLASLt's epilogue, erf through F.linear + the pass
        expected = "cublaslt" if approximate == "tanh" else "gelu_pass"
        assert calls and all(call == (expected, True) for call in calls), calls
        want = dense_gelu_reference(x, w, b, approximate)
        for g, r in zip(got, want, strict=True):
            torch.testing.assert_close(g, r)


# ---------------------------------------------------------------------------- CUDA


_NAMES = ["out", "grad_x", "grad_weight", "grad_bias"]


def _errors(fn, ref_fn, x, w, b, grad):
    """Max abs error of fn's (out, grads) against the fp32 reference, per output."""
    ours = _grads(fn, x, w, b, grad)
    ref = _grads(ref_fn, *(t.detach().float().requires_grad_() if t is not None else None for t in (x, w, b)),
                 grad.float())
    return [(a.float() - r).abs().max().item() for a, r in zip(ours, ref, strict=True)]


@pytest.mark.cuda
def test_extension_builds():
    dense._extension()
    assert hasattr(torch.ops.flash, "cublaslt_linear_gelu_tanh")


def test_cpu_has_no_algo_picks(monkeypatch):
    monkeypatch.setattr(dense._cpp_build, "_loaded", {})
    assert dense.cublaslt_algo_picks() == []


PICK_LINE = (r": candidate (\d+) of (\d+) \(id \d+ tile \d+ stages \d+ splitk \d+ custom \d+ cluster \d+\), "
             r"heuristic (\d+), us( (\d+\.\d+|fail))+$")


def _pick_times(line: str) -> list[str]:
    """Each candidate's time in a pick line, in candidate order: microseconds, or "fail"."""
    return line.rsplit(", us ", 1)[1].split()


@pytest.mark.cuda
def test_algo_picks_report_each_timed_problem():
    """A GEMM problem not seen before is timed over its candidates once: one line naming the problem, the
    kept candidate and a time per candidate; calling it again times nothing."""
    k, n = 264, 1064  # a problem no other test uses
    x, w, b = _inputs((517, k), n, torch.bfloat16, "cuda")
    linear_bias(x, w, b)
    picks = dense.cublaslt_algo_picks()
    mine = [p for p in picks if f"x{k}/" in p and f"{n}x" in p]
    assert len(mine) == 1, picks
    assert re.search(PICK_LINE, mine[0]), mine[0]
    kept, found = map(int, re.search(r"candidate (\d+) of (\d+)", mine[0]).groups())
    times = _pick_times(mine[0])
    assert len(times) == found and times[kept] != "fail"
    assert float(times[kept]) == min(float(t) for t in times if t != "fail")
    linear_bias(x, w, b)
    assert len(dense.cublaslt_algo_picks()) == len(picks)


@pytest.mark.cuda
def test_extra_candidates_are_timed_with_the_heuristics():
    """csrc's kExtraConfigs join the heuristic's candidates: on the cuBLAS and chip they were found on (13.x,
    sm_90), a GELU_AUX_BIAS problem times more candidates than the heuristic offered, and the kept one is
    the fastest of all."""
    k, n = 384, 1152  # a problem no other test uses
    x, w, b = _inputs((777, k), n, torch.bfloat16, "cuda")
    torch.ops.flash.cublaslt_linear_gelu_tanh(x, w, b, True)
    mine = [p for p in dense.cublaslt_algo_picks() if f"x{k}/" in p and f"{n}x" in p]
    assert len(mine) == 1, mine
    kept, found, heuristic = map(int, re.search(PICK_LINE, mine[0]).groups()[:3])
    assert 1 <= heuristic <= found
    times = _pick_times(mine[0])
    assert float(times[kept]) == min(float(t) for t in times if t != "fail")
    if torch.cuda.get_device_capability() == (9, 0) and int(torch.version.cuda.split(".")[0]) >= 13:
        assert found > heuristic, mine[0]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_cublaslt_candidate_is_correct(dtype):
    """Each configuration run_gemm may keep for a problem (the heuristic's and kExtraConfigs), forced in turn,
    against fp32 on random inputs with an odd M: one outside the heuristic's list must be as right as the
    ones it offers. A candidate that cuBLASLt refuses at run time ("fail" in the pick line) is never kept."""
    m, k, n = 1031, 392, 1176  # problems no other test uses
    x, w, b = _inputs((m, k), n, dtype, "cuda")
    grad = torch.randn(m, n, dtype=dtype, device="cuda")
    pre = F.linear(x.float(), w.float(), b.float())
    ops = torch.ops.flash
    wgrad = grad.float().t() @ x.float()
    problems = {  # name: (call, [fp32 reference of each output], atol)
        "gelu_aux_bias": (lambda: ops.cublaslt_linear_gelu_tanh(x, w, b, True),
                          [F.gelu(pre, approximate="tanh"), pre], 3e-2),
        "bias": (lambda: [ops.cublaslt_linear(x, w, b)], [pre], 3e-2),
        "wgrad": (lambda: [ops.cublaslt_linear_wgrad(grad, x)], [wgrad], 2e-2 * m**0.5),
        "wgrad_bgrad": (lambda: ops.cublaslt_linear_wgrad_bgrad(grad, x), [wgrad, grad.float().sum(0)],
                        2e-2 * m**0.5),
    }
    try:
        for name, (call, refs, atol) in problems.items():
            ops.cublaslt_force_candidate(-1)
            before = len(dense.cublaslt_algo_picks())
            call()  # measured: its pick line lists every candidate and which ones cuBLASLt refused
            picks = dense.cublaslt_algo_picks()[before:]
            assert len(picks) == 1, (name, picks)
            times = _pick_times(picks[0])
            checked = 0
            for index, time in enumerate(times):
                if time == "fail":
                    continue
                ops.cublaslt_force_candidate(index)
                where = f"{name}, candidate {index}: "
                for got, ref in zip(call(), refs, strict=True):
                    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=2e-2,
                                               msg=lambda text, where=where: where + text)
                checked += 1
            assert checked >= 1, picks[0]
    finally:
        ops.cublaslt_force_candidate(-1)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1001, 0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_weight_gradient_matches_reference(m, dtype):
    """grad.T @ x, with and without the BGRADB bias gradient, against fp32 on random inputs (odd M)."""
    dense._extension()
    grad = torch.randn(m, 1064, dtype=dtype, device="cuda")
    x = torch.randn(m, 264, dtype=dtype, device="cuda")
    ref = grad.float().t() @ x.float()
    tol = dict(atol=2e-2 * max(1, m) ** 0.5, rtol=2e-2)
    torch.testing.assert_close(torch.ops.flash.cublaslt_linear_wgrad(grad, x).float(), ref, **tol)
    grad_weight, grad_bias = torch.ops.flash.cublaslt_linear_wgrad_bgrad(grad, x)
    torch.testing.assert_close(grad_weight.float(), ref, **tol)
    torch.testing.assert_close(grad_bias.float(), grad.float().sum(0), **tol)


@pytest.mark.cuda
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,n,bias", [((97, 768), 3072, True), ((1000, 256), 1024, True),
                                          ((4, 250, 512), 1536, True), ((1000, 256), 1024, False)])
def test_cuda_matches_reference(approximate, dtype, shape, n, bias):
    x, w, b = _inputs(shape, n, dtype, "cuda", bias=bias, requires_grad=True)
    grad = torch.randn(*shape[:-1], n, dtype=dtype, device="cuda")
    gelu = lambda x, w, b: F.gelu(F.linear(x, w, b), approximate=approximate)
    ours = _errors(lambda x, w, b: linear_bias_gelu(x, w, b, approximate), gelu, x, w, b, grad)
    torch_lp = _errors(gelu, gelu, x, w, b, grad)
    floor = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for name, e, e_torch in zip(_NAMES[: len(ours)], ours, torch_lp, strict=True):
        assert e <= 2 * e_torch + floor, (name, e, e_torch)
    with torch.no_grad():  # the inference op (no pre-activation stored)
        ref = gelu(*(t.float() if t is not None else None for t in (x, w, b)))
        e_inf = (linear_bias_gelu(x, w, b, approximate).float() - ref).abs().max().item()
    assert e_inf <= 2 * torch_lp[0] + floor, ("inference out", e_inf, torch_lp[0])
    ours = _errors(linear_bias, F.linear, x, w, b, grad)
    torch_lp = _errors(F.linear, F.linear, x, w, b, grad)
    for name, e, e_torch in zip(_NAMES[: len(ours)], ours, torch_lp, strict=True):
        assert e <= 2 * e_torch + floor, (name, e, e_torch)


@pytest.mark.cuda
def test_cublaslt_gelu_epilogue_is_tanh():
    """The GELU epilogue is the tanh approximation. Pre-activations are laid out exactly (x = I) over
    [-6, 6] in fp16; on the negative side the outputs are small (fp16 rounding <= 6e-5) while erf and tanh
    GELU differ by up to 5e-4, so the epilogue's output must sit on one curve and off the other."""
    dense._extension()
    k = 64
    x = torch.eye(k, dtype=torch.float16, device="cuda")
    w = torch.linspace(-6, 6, 64 * k, device="cuda").view(64, k).half()
    b = torch.zeros(64, dtype=torch.float16, device="cuda")
    out, pre = torch.ops.flash.cublaslt_linear_gelu_tanh(x, w, b, True)
    assert torch.equal(pre, w.t())  # the aux output is the exact pre-activation
    out_inference, _ = torch.ops.flash.cublaslt_linear_gelu_tanh(x, w, b, False)  # GELU_BIAS, no aux
    torch.testing.assert_close(out_inference, out, atol=1e-3, rtol=0)
    p = pre.double()
    neg = p < 0

    def max_err(y, approximate):
        return (y.double() - F.gelu(p, approximate=approximate))[neg].abs().max().item()

    err_tanh, err_erf = max_err(out, "tanh"), max_err(out, "none")
    print(f"GELU epilogue (pre < 0): max |out - gelu_tanh| = {err_tanh:.2e}, "
          f"max |out - gelu_erf| = {err_erf:.2e}")
    assert err_tanh < err_erf / 4
    # ...so approximate="none" must not take it: the exact path stays on the erf curve.
    out_none = linear_bias_gelu(x, w, b, "none")
    assert max_err(out_none, "none") < err_erf / 4
    assert max_err(linear_bias_gelu(x, w, b, "tanh"), "tanh") < err_erf / 4


@pytest.mark.cuda
def test_cublaslt_dgelu_bgrad_epilogue():
    dense._extension()
    m, n, h = 1000, 512, 768
    grad = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, h, dtype=torch.bfloat16, device="cuda") / n**0.5
    pre = torch.randn(m, h, dtype=torch.bfloat16, device="cuda")
    grad_pre, grad_bias = torch.ops.flash.cublaslt_linear_dgrad_dgelu_bgrad(grad, w, pre)
    ref = torch.ops.aten.gelu_backward(grad.float() @ w.float(), pre.float(), approximate="tanh")
    torch.testing.assert_close(grad_pre.float(), ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(grad_bias.float(), ref.sum(0), atol=0.5, rtol=3e-2)


@pytest.mark.cuda
def test_unsupported_shapes_fall_back():
    x, w, b = _inputs((33, 20), 12, torch.bfloat16, "cuda")  # K, N not multiples of 8
    out = linear_bias_gelu(x, w, b, "tanh")
    ref, _ = dense_gelu_reference(x, w, b, "tanh")
    torch.testing.assert_close(out, ref)
    x, w, b = _inputs((33, 64), 32, torch.float32, "cuda")  # fp32: reference
    torch.testing.assert_close(linear_bias_gelu(x, w, b), F.gelu(F.linear(x, w, b)))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck_cuda(dtype):
    _opcheck_all("cuda", dtype)
    dense._extension()
    x, w, b = _inputs((40, 64), 32, dtype, "cuda")
    opcheck(torch.ops.flash.cublaslt_linear_gelu_tanh, (x, w, b, True))
    opcheck(torch.ops.flash.cublaslt_linear_gelu_tanh, (x, w, None, False))
    opcheck(torch.ops.flash.cublaslt_linear, (x, w, None))
    opcheck(torch.ops.flash.cublaslt_linear_wgrad_bgrad, (torch.randn(40, 32, dtype=dtype, device="cuda"), x))
    opcheck(torch.ops.flash.cublaslt_linear_wgrad, (torch.randn(40, 32, dtype=dtype, device="cuda"), x))


# --------------------------------------------------------------- the Triton forward (per-problem choice)


def _triton_errors(x, w, b, approximate, store_pre, config):
    out, pre = dense.triton_linear_gelu(x, w, b, approximate, store_pre, config)
    exact_pre = F.linear(x.double(), w.double(), b.double() if b is not None else None)
    exact = F.gelu(exact_pre, approximate=approximate)
    eager_pre = F.linear(x, w, b)
    errors = {"out": ((out.double() - exact).abs().max().item(),
                      (F.gelu(eager_pre, approximate=approximate).double() - exact).abs().max().item())}
    if store_pre:
        errors["pre"] = ((pre.double() - exact_pre).abs().max().item(),
                         (eager_pre.double() - exact_pre).abs().max().item())
    else:
        assert pre.numel() == 0
    return errors


@pytest.mark.interpret
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(37, 24, 40), (130, 72, 136)])  # odd M; K ragged against BLOCK_K
def test_interpret_triton_linear_gelu(approximate, bias, shape):
    m, k, n = shape
    x, w, b = _inputs((m, k), n, bias=bias)
    for store_pre in (True, False):
        for config in ((16, 16, 16, 2, 1, 1), (32, 16, 32, 1, 1, 1)):  # several groups; wrapped tiles
            for name, (ours, eager) in _triton_errors(x, w, b, approximate, store_pre, config).items():
                assert ours <= 2 * eager + 1e-5, (name, ours, eager)


@pytest.mark.cuda
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,bias", [((1000, 768, 3072), True), ((97, 1600, 6400), False),
                                        ((4099, 256, 1024), True)])
def test_cuda_triton_configs_match(approximate, dtype, shape, bias):
    m, k, n = shape
    x, w, b = _inputs((m, k), n, dtype, "cuda", bias=bias)
    floor = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for config in dense.TRITON_CONFIGS:
        for store_pre in (True, False):
            for name, (ours, eager) in _triton_errors(x, w, b, approximate, store_pre, config).items():
                assert ours <= 2 * eager + floor, (config, name, ours, eager)


@pytest.mark.cuda
def test_cuda_forward_path_is_measured_and_kept():
    x, w, b = _inputs((512, 768), 3072, torch.bfloat16, "cuda")
    with torch.no_grad():
        first = linear_bias_gelu(x, w, b, "none")
        again = linear_bias_gelu(x, w, b, "none")
    choices = {key: name for key, name in dense.forward_path_choices().items()
               if key[1:] == (torch.bfloat16, 512, 768, 3072, True, "none", False)}
    assert len(choices) == 1 and next(iter(choices.values())) in (
        "cublaslt", *("triton" + "x".join(map(str, c)) for c in dense.TRITON_CONFIGS))
    torch.testing.assert_close(first, again, rtol=0, atol=0)  # the kept choice runs, deterministically


# ---------------------------------------------------------------------------- the GELU passes


def _gelu_backward_errors(grad, pre, approximate, config):
    """{output: (our max error, eager's max error)} against fp64, for the GELU' + bias-gradient pass; eager is
    aten in pre's dtype (gelu_backward, then .sum(0) of its result)."""
    exact_grad_pre = torch.ops.aten.gelu_backward(grad.double(), pre.double(), approximate=approximate)
    exact = {"grad_pre": exact_grad_pre, "grad_bias": exact_grad_pre.sum(0)}
    eager_grad_pre = torch.ops.aten.gelu_backward(grad, pre, approximate=approximate)
    eager = {"grad_pre": eager_grad_pre, "grad_bias": eager_grad_pre.sum(0)}
    grad_pre, grad_bias = dense.gelu_backward_dbias(grad, pre, approximate, config=config)
    ours = {"grad_pre": grad_pre, "grad_bias": grad_bias}
    assert grad_bias.dtype == pre.dtype and grad_bias.shape == (pre.shape[1],)
    without_bias = dense.gelu_backward_dbias(grad, pre, approximate, with_dbias=False, config=config)
    assert without_bias[1] is None and torch.equal(without_bias[0], grad_pre)
    return {name: ((ours[name].double() - exact[name]).abs().max().item(),
                   (eager[name].double() - exact[name]).abs().max().item()) for name in exact}


# (BLOCK_M, BLOCK_N, num_warps, programs per SM, stages, polynomial CDF): small tiles so that odd shapes take
# ragged row chunks, ragged column blocks and several chunks per column.
_SMALL_GELU_CONFIGS = [(4, 16, 1, 1, 1, False), (2, 8, 1, 3, 2, True)]


@pytest.mark.interpret
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("shape", [(37, 40), (130, 7), (1, 8), (5, 1)])
def test_interpret_gelu_backward_pass(interpreter, approximate, shape):
    # fp32 only: the interpreter truncates fp32 -> bf16 (5.34375 -> 5.3125) where the GPU rounds to nearest;
    # the half-precision rounding is the cuda test's.
    pre = torch.randn(shape) * 3  # out to where GELU' bends and saturates
    grad = torch.randn(shape)
    for config in _SMALL_GELU_CONFIGS:
        for name, (ours, eager) in _gelu_backward_errors(grad, pre, approximate, config).items():
            # As in the cuda test: the bias gradient sums M values, each off by up to the tanh GELU''s
            # ~4e-6 here, so its error grows with sqrt(M) (a flat 1e-5 failed ~1 run in 5 at M=130).
            bound = 2 * eager + 1e-5 * (shape[0] ** 0.5 if name == "grad_bias" else 1.0)
            assert ours <= bound, (config, name, ours, eager)


def test_gelu_backward_of_no_rows_is_empty_and_zero_bias():
    pre = torch.randn(0, 24)
    grad_pre, grad_bias = dense.gelu_backward_dbias(torch.randn(0, 24), pre, "none")
    assert grad_pre.shape == (0, 24) and torch.equal(grad_bias, torch.zeros(24))


@pytest.mark.cuda
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(97, 3072), (4099, 1000), (16384, 768), (3, 6400)])
def test_cuda_gelu_backward_pass(approximate, dtype, shape):
    pre = torch.randn(shape, dtype=dtype, device="cuda") * 3
    grad = torch.randn(shape, dtype=dtype, device="cuda")
    floor = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for config in (*dense.GELU_BWD_CONFIGS.values(), *_SMALL_GELU_CONFIGS, (32, 256, 8, 8, 2, True),
                   (32, 256, 8, 8, 2, False)):
        for name, (ours, eager) in _gelu_backward_errors(grad, pre, approximate, config).items():
            # the bias gradient sums M rounded values: its error grows with sqrt(M) in either order
            bound = 2 * eager + floor * (shape[0] ** 0.5 if name == "grad_bias" else 1.0)
            assert ours <= bound, (config, name, ours, eager)


def _gelu_forward_errors(pre, config):
    """(our max error, eager's max error) of the erf GELU's forward pass against fp64; eager is F.gelu in
    pre's dtype. Also checks the pass in place gives the same values."""
    exact = F.gelu(pre.double())
    ours = dense.gelu_erf_forward(pre, config=config)
    assert ours.shape == pre.shape and ours.dtype == pre.dtype
    in_place = pre.clone()
    assert dense.gelu_erf_forward(in_place, out=in_place, config=config) is in_place
    assert torch.equal(in_place, ours)
    if pre.numel() == 0:
        return 0.0, 0.0
    return (ours.double() - exact).abs().max().item(), (F.gelu(pre).double() - exact).abs().max().item()


# (BLOCK, num_warps, polynomial CDF): a block smaller than the tensors (ragged last block), both CDFs.
_SMALL_GELU_FWD_CONFIGS = [(16, 1, True), (64, 2, False)]


@pytest.mark.interpret
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("shape", [(37, 40), (5, 1), (1, 8), (0, 8)])
def test_interpret_gelu_forward_pass(interpreter, shape):
    # fp32 only: the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest (the cuda test's)
    pre = torch.randn(shape) * 3  # into both tails, where the CDF saturates and the cancellation is
    pre.view(-1)[:3] = torch.tensor([-9.0, 9.0, 0.0])[: pre.numel()]
    for config in _SMALL_GELU_FWD_CONFIGS:
        ours, eager = _gelu_forward_errors(pre, config)
        assert ours <= 2 * eager + 1e-6, (config, ours, eager)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(97, 3072), (4099, 1000), (16384, 768), (3, 5)])
def test_cuda_gelu_forward_pass(dtype, shape):
    pre = torch.randn(shape, dtype=dtype, device="cuda") * 3
    floor = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-6}[dtype]
    for config in (dense.GELU_FWD_CONFIG, *_SMALL_GELU_FWD_CONFIGS, (4096, 8, True)):
        ours, eager = _gelu_forward_errors(pre, config)
        assert ours <= 2 * eager + floor, (config, ours, eager)
