"""flash::add_dropout_norm_{fwd,bwd}: reference, opcheck, autograd, dropout, errors (CPU); the Triton kernels
under the interpreter (tiny shapes); the CUDA kernels against an fp64 reference (GPU only)."""

import pytest
import torch
import torch.nn.functional as F

import flash_backend.ops.add_dropout_norm as adn
from flash_backend.ops._philox import dropout_scale
from flash_backend.ops.add_dropout_norm import add_dropout_norm, dropout_keep_mask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _inputs(shape, dtype, device="cpu", residual=True, weight=True, bias=True, res_dtype=None,
            requires_grad=False):
    n = shape[-1]
    x = torch.randn(shape, device=device, dtype=dtype)
    r = torch.randn(shape, device=device, dtype=res_dtype or dtype) if residual else None
    w = (1 + 0.5 * torch.randn(n, device=device, dtype=dtype)) if weight else None
    b = 0.5 * torch.randn(n, device=device, dtype=dtype) if bias else None
    if requires_grad:
        for t in (x, r, w, b):
            if t is not None:
                t.requires_grad_(True)
    return x, r, w, b


def _seed(device="cpu"):
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def _eager(x, r, w, b, keep, p, eps, rms, upcast=False):
    """Plain torch: dropout with the given keep-mask, residual add, F.layer_norm / F.rms_norm."""
    cast = (lambda t: t.double() if t is not None else None) if upcast else (lambda t: t)
    x, r, w, b = cast(x), cast(r), cast(w), cast(b)
    h = x
    if p > 0:
        h = torch.where(keep.reshape(x.shape), x * dropout_scale(p), 0.0).to(x.dtype)
    if r is not None:
        h = h + r
    n = x.shape[-1]
    out = F.rms_norm(h, (n,), w, eps) if rms else F.layer_norm(h, (n,), w, b, eps)
    return out, h


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


# ----------------------------------------------------------------------------------------------------------
# CPU: reference and op
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_cpu_op_matches_fp64(dtype, rms, p):
    x, r, w, b = _inputs((3, 5, 97), dtype, bias=not rms)
    seed = _seed()
    out, h, mean, rstd = torch.ops.flash.add_dropout_norm_fwd(x, r, w, b, seed if p else None, 1e-5, p, rms,
                                                              False, True)
    keep = dropout_keep_mask(seed, 15, 97, p) if p else None
    ref_out, ref_h = _eager(x, r, w, b, keep, p, 1e-5, rms, upcast=True)
    lp_out, lp_h = _eager(x, r, w, b, keep, p, 1e-5, rms)
    assert out.dtype == lp_out.dtype and h.dtype == lp_h.dtype
    assert _max_err(out, ref_out) <= 2 * _max_err(lp_out, ref_out) + FLOOR[dtype]
    assert _max_err(h, ref_h) <= 2 * _max_err(lp_h, ref_h) + FLOOR[dtype]
    assert mean.shape == ((0,) if rms else (15,)) and rstd.shape == (15,)


def test_dtype_promotion_and_residual_in_fp32():
    x, r, w, b = _inputs((4, 64), torch.bfloat16, res_dtype=torch.float32)
    out, h = add_dropout_norm(x, r, w, b, return_residual=True)
    assert out.dtype == F.layer_norm(x + r, (64,), w.float(), b.float()).dtype == torch.float32
    assert h.dtype == torch.float32
    x, r, w, b = _inputs((4, 64), torch.bfloat16)
    out, h = add_dropout_norm(x, r, w, b, residual_in_fp32=True, return_residual=True)
    assert out.dtype == torch.bfloat16 and h.dtype == torch.float32
    torch.testing.assert_close(h, x.float() + r.float())


_OPCHECK_CASES = [
    # (dtype, residual, weight, bias, p, rms, residual_in_fp32, return_residual, noncontiguous)
    (torch.float32, True, True, True, 0.0, False, False, True, False),
    (torch.float32, False, False, False, 0.0, False, False, False, False),
    (torch.bfloat16, True, True, True, 0.3, False, True, False, True),
    (torch.float16, True, True, False, 0.1, True, False, True, False),
    (torch.float32, False, True, False, 0.5, True, False, False, True),
]


@pytest.mark.parametrize("case", _OPCHECK_CASES)
def test_opcheck_cpu(case):
    _opcheck(case, "cpu")


def _opcheck(case, device):
    dtype, has_r, has_w, has_b, p, rms, in_fp32, ret, noncontig = case
    x, r, w, b = _inputs((6, 40), dtype, device, has_r, has_w, has_b and not rms, requires_grad=True)
    if noncontig:  # transposed storage: neither rows nor columns are contiguous
        x = x.detach().t().contiguous().t().requires_grad_()
        r = r.detach().t().contiguous().t().requires_grad_() if r is not None else None
        assert not x.is_contiguous()
    seed = _seed(device) if p else None
    fwd_args = (x, r, w, b, seed, 1e-5, p, rms, in_fp32, ret)
    torch.library.opcheck(torch.ops.flash.add_dropout_norm_fwd, fwd_args)
    with torch.no_grad():
        _, h, mean, rstd = torch.ops.flash.add_dropout_norm_fwd(*fwd_args)
    if not h.numel():
        h = x.detach()
    dy = torch.randn(x.shape, device=device, dtype=dtype)
    dres = torch.randn(h.shape, device=device, dtype=h.dtype) if ret else None
    detach = lambda t: t.detach() if t is not None else None  # no double backward
    bwd_args = (dy, dres, h, detach(w), detach(b), mean, rstd, seed, p, rms, has_r, x.dtype,
                r.dtype if has_r else x.dtype)
    torch.library.opcheck(torch.ops.flash.add_dropout_norm_bwd, bwd_args)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("return_residual", [False, True])
def test_grads_match_plain_torch(rms, p, return_residual):
    x, r, w, b = _inputs((2, 7, 50), torch.float32, bias=not rms,
                         requires_grad=True)
    torch.manual_seed(1234)
    seed = _seed()
    keep = dropout_keep_mask(seed, 14, 50, p) if p else None
    torch.manual_seed(1234)
    got = add_dropout_norm(x, r, w, b, dropout_p=p, is_rms_norm=rms, return_residual=return_residual)
    ref_out, ref_h = _eager(x, r, w, b, keep, p, 1e-5, rms)
    dout = torch.randn_like(ref_out)
    dh = torch.randn_like(ref_h)
    if return_residual:
        out, h = got
        loss, ref_loss = (out * dout).sum() + (h * dh).sum(), (ref_out * dout).sum() + (ref_h * dh).sum()
    else:
        loss, ref_loss = (got * dout).sum(), (ref_out * dout).sum()
    params = [t for t in (x, r, w, b) if t is not None]
    grads = torch.autograd.grad(loss, params)
    ref_grads = torch.autograd.grad(ref_loss, params)
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, atol=2e-5, rtol=2e-5)


def test_grads_without_residual_or_affine():
    x = torch.randn(5, 33, requires_grad=True)
    dout = torch.randn(5, 33)
    (gx,) = torch.autograd.grad((add_dropout_norm(x) * dout).sum(), x)
    (rx,) = torch.autograd.grad((F.layer_norm(x, (33,)) * dout).sum(), x)
    torch.testing.assert_close(gx, rx, atol=1e-5, rtol=1e-5)


def test_empty_rows_and_module():
    x = torch.randn(0, 3, 16, requires_grad=True)
    out, h = add_dropout_norm(x, torch.randn(0, 3, 16), dropout_p=0.1, return_residual=True)
    assert out.shape == h.shape == (0, 3, 16)
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert gx.shape == x.shape
    norm = adn.AddDropoutNorm(16, dropout_p=0.2, is_rms_norm=True).eval()
    x, r = torch.randn(4, 16), torch.randn(4, 16)
    out, h = norm(x, r, return_residual=True)
    torch.testing.assert_close(out, F.rms_norm(x + r, (16,), norm.weight, 1e-5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, x + r)


@pytest.mark.parametrize("use", ["out", "h", "both"])
def test_backward_gets_no_zero_filled_grads(use):
    # A post-norm block uses only `out`; the op returns h (the pre-norm sum) to save it for backward. h's
    # unused grad must reach the backward op as None, not as an (M, N) zeros tensor that a fill kernel writes
    # and the backward kernel reads (24 of each per compiled BERT-base step on the H200, ~0.2 ms). With only
    # h used, `out`'s grad is the missing one, and the kernel needs a dy: one fill. Grads match the
    # reference either way. (A dispatch mode sees what the registered autograd passes to the backward op.)
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append((func, args))
            return func(*args, **(kwargs or {}))

    def loss(out, h):
        return {"out": (out * out).sum(), "h": (h * h).sum(), "both": (out * out).sum() + h.sum()}[use]

    x, r, w, b = _inputs((5, 48), torch.float32, requires_grad=True)
    params = (x, r, w, b) if use != "h" else (x, r)
    seed = _seed()
    args = (x, r, w, b, seed, 1e-5, 0.1, False, False, True)
    out, h = torch.ops.flash.add_dropout_norm_fwd(*args)[:2]
    with Log():
        got = torch.autograd.grad(loss(out, h), params)
    out_ref, h_ref = adn.add_dropout_norm_ref(*args[:-1])[:2]
    expected = torch.autograd.grad(loss(out_ref, h_ref), params)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    (bwd_args,) = [a for f, a in calls if f is torch.ops.flash.add_dropout_norm_bwd.default]
    assert (bwd_args[1] is None) == (use == "out")  # dresidual_out
    fills = [f for f, a in calls if f in (torch.ops.aten.zeros.default, torch.ops.aten.full.default,
                                          torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)]
    assert len(fills) == (1 if use == "h" else 0), fills


def test_compile_aot_eager_fullgraph():
    x, r, w, b = _inputs((4, 96), torch.float32, requires_grad=True)

    def f(x, r, w, b):
        out, h = add_dropout_norm(x, r, w, b, dropout_p=0.1, return_residual=True)
        return (out * out).sum() + h.sum()

    torch.manual_seed(7)
    expected = torch.autograd.grad(f(x, r, w, b), (x, r, w, b))
    torch.manual_seed(7)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(x, r, w, b), (x, r, w, b))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


# ----------------------------------------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------------------------------------


def _dropout_only(shape, p, device="cpu"):
    """h = dropout(ones) through the public function: the mask, scaled."""
    x = torch.ones(shape, device=device)
    _, h = add_dropout_norm(x, dropout_p=p, return_residual=True)
    return h


def test_dropout_reproducible_under_manual_seed():
    x, r, w, b = _inputs((8, 64), torch.float32)
    torch.manual_seed(3)
    a = add_dropout_norm(x, r, w, b, dropout_p=0.5)
    torch.manual_seed(3)
    c = add_dropout_norm(x, r, w, b, dropout_p=0.5)
    d = add_dropout_norm(x, r, w, b, dropout_p=0.5)
    torch.testing.assert_close(a, c, rtol=0, atol=0)
    assert not torch.equal(a, d)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_statistics_cpu(p):
    _check_dropout_statistics(p, "cpu", (256, 1000))


def _check_dropout_statistics(p, device, shape):
    h = _dropout_only(shape, p, device)
    kept = h != 0
    numel = h.numel()
    sigma = (p * (1 - p) / numel) ** 0.5
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * sigma
    # Kept values are scaled by the inverse of the exact keep probability of p quantised to 1/65536.
    torch.testing.assert_close(h[kept], torch.full_like(h[kept], dropout_scale(p)))
    assert abs(dropout_scale(p) - 1 / (1 - p)) <= 2**-16 / (1 - p) ** 2
    # No structure: rows, columns and the 8 columns served by one Philox call all keep about 1 - p.
    for dim_mean in (kept.float().mean(0), kept.float().mean(1)):
        n_per = numel // dim_mean.numel()
        assert (dim_mean - (1 - p)).abs().max().item() < 6 * (p * (1 - p) / n_per) ** 0.5
    lanes = kept[:, : shape[1] // 8 * 8].reshape(shape[0], -1, 8).float().mean((0, 1))
    assert (lanes - (1 - p)).abs().max().item() < 6 * (p * (1 - p) / (numel / 8)) ** 0.5
    # Neighbouring rows do not share a mask.
    assert (kept[1:] != kept[:-1]).float().mean().item() > p * (1 - p)


def test_dropout_p_zero_draws_no_seed():
    x = torch.randn(3, 16)
    state = torch.get_rng_state()
    add_dropout_norm(x)
    assert torch.equal(state, torch.get_rng_state())


# ----------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(residual=torch.randn(4, 9)), ValueError, "residual"),
        (dict(weight=torch.randn(7)), ValueError, "weight"),
        (dict(bias=torch.randn(9)), ValueError, "bias"),
        (dict(x=torch.randn(4, 8, dtype=torch.float64)), TypeError, "x has dtype"),
        (dict(residual=torch.randn(4, 8).to(torch.int32)), TypeError, "residual has dtype"),
        (dict(dropout_p=1.0), ValueError, "dropout_p"),
        (dict(dropout_p=-0.1), ValueError, "dropout_p"),
        (dict(x=torch.randn(2, 65537)), ValueError, "65536"),
        (dict(x=torch.randn(2, 0)), ValueError, "N=0"),
        (dict(weight=torch.randn(8, device="meta")), ValueError, "weight is on meta"),
        (dict(bias=torch.randn(8), is_rms_norm=True), ValueError, "bias"),
    ],
)
def test_bad_input_raises(kwargs, exc, match):
    x = kwargs.pop("x", torch.randn(4, 8))
    with pytest.raises(exc, match=match):
        add_dropout_norm(x, **kwargs)


# ----------------------------------------------------------------------------------------------------------
# Interpreter: the Triton kernels on CPU tensors (TRITON_INTERPRET=1 is set by conftest without CUDA)
# ----------------------------------------------------------------------------------------------------------


def _compare_launchers(rows, n, dtype, rms, p, has_residual, device="cpu", atol=None, bwd_config=None):
    x, r, w, b = _inputs((rows, n), dtype, device, has_residual, True, not rms)
    seed = _seed(device) if p else None
    args = (x, r, w, b, seed, 1e-5, p, rms, False, True)
    got = adn.add_dropout_norm_fwd_launch(*args)
    ref = adn._fwd_cpu(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    tol = dict(atol=atol or FLOOR[dtype] * 10, rtol=FLOOR[dtype] * 10)
    for g, e in zip(got, ref, strict=True):
        torch.testing.assert_close(g.cpu(), e, **tol)
    _, h, mean, rstd = got
    dy = torch.randn_like(x)
    dres = torch.randn_like(h)
    bargs = (dy, dres, h, w, b, mean, rstd, seed, p, rms, has_residual, x.dtype, x.dtype)
    got = adn.add_dropout_norm_bwd_launch(*bargs, config=bwd_config)
    ref = adn._bwd_cpu(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in bargs])
    for g, e in zip(got, ref, strict=True):
        torch.testing.assert_close(g.cpu(), e, **tol)


@pytest.mark.interpret
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("n", [1, 7, 33, 100])
@pytest.mark.parametrize("rms", [False, True])
def test_interpret_kernels(n, rms):
    for rows, dtype, p, has_residual in [(3, torch.float32, 0.0, False), (5, torch.float32, 0.3, True),
                                         (4, torch.bfloat16, 0.1, True)]:
        _compare_launchers(rows, n, dtype, rms, p, has_residual)


@pytest.mark.interpret
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("rms", [False, True])
def test_interpret_chunked_rows(monkeypatch, rms):
    """Rows wider than the register limit loop over chunks; shrink the limit so tiny rows take that path."""
    monkeypatch.setattr(adn, "_MAX_FUSED_N_FWD", 16)
    for n in (17, 100):
        _compare_launchers(5, n, torch.float32, rms, 0.2, True, bwd_config=adn.BwdConfig(8, 32, max_fused=32))


class _LaunchSpy:
    """`launch=` wrapper that records the meta-parameters of each kernel launch."""

    def __init__(self):
        self.meta = []

    def __call__(self, kernel):
        def grid(g):
            def run(*args, **kwargs):
                self.meta.append(kwargs)
                return kernel[g](*args, **kwargs)

            return run

        return type("Spied", (), {"__getitem__": lambda _, g: grid(g)})()


def _check_bwd_variant(config, rows, n, rms, p, has_residual, has_weight, has_bias, has_dres,
                       dtype=torch.float32, device="cpu", expect_rows_per_iter=None, expect_prefetch=None,
                       expect_stages=None, expect_reload=None):
    """The backward launcher under `config` against the reference backward, on forward outputs of the kernel's
    own reference (so that only the backward is under test)."""
    x, r, w, b = _inputs((rows, n), dtype, device, has_residual, has_weight, has_bias and not rms)
    seed = _seed(device) if p else None
    _, h, mean, rstd = adn._fwd_cpu(x, r, w, b, seed, 1e-5, p, rms, False, True)
    dy = torch.randn_like(x)
    dres = torch.randn_like(h) if has_dres else None
    bargs = (dy, dres, h, w, b, mean, rstd, seed, p, rms, has_residual, x.dtype, x.dtype)
    spy = _LaunchSpy()
    got = adn.add_dropout_norm_bwd_launch(*bargs, config=config, launch=spy)
    if expect_rows_per_iter is not None:
        assert spy.meta[0]["ROWS_PER_ITER"] == expect_rows_per_iter and spy.meta[0]["NUM_CHUNKS"] == 1
    if expect_prefetch is not None:
        assert spy.meta[0]["PREFETCH"] == expect_prefetch
    if expect_stages is not None:
        assert spy.meta[0]["PIPELINE_STAGES"] == expect_stages
    if expect_reload is not None:
        assert spy.meta[0]["RELOAD_ROWS"] == expect_reload
    ref = adn._bwd_cpu(*bargs)
    tol = dict(atol=FLOOR[dtype] * 10, rtol=FLOOR[dtype] * 10)
    for name, g, e in zip(("dx", "dresidual", "dweight", "dbias"), got, ref, strict=True):
        assert g.shape == e.shape, name
        torch.testing.assert_close(g, e, **tol, msg=lambda m, name=name: f"{name}: {m}")


# (N, dropout_p, residual, weight, bias, dresidual_out): every flag on and off at least once; N=1 is the
# exact-mean LayerNorm case, 97 and 1000 leave masked-off columns.
_BWD_VARIANT_CASES = [
    (97, 0.3, True, True, True, True),
    (97, 0.0, False, True, False, False),
    (97, 0.2, True, False, False, True),
    (97, 0.0, True, False, True, False),
    (1, 0.2, True, True, True, True),
    (1000, 0.1, True, True, True, True),
]


@pytest.mark.interpret
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")
@pytest.mark.usefixtures("interpreter")  # loop bounds that are runtime scalars (the pipelined loop)
@pytest.mark.parametrize("rows_per_iter,prefetch,stages,reload", [
    (1, False, 0, False), (1, True, 0, False), (2, False, 0, False), (4, False, 0, False),
    (2, True, 0, False), (1, False, 3, False), (1, True, 2, False), (2, False, 3, False),
    (1, False, 0, True), (1, True, 0, True), (1, False, 3, True), (2, False, 0, True)])
@pytest.mark.parametrize("rms", [False, True])
def test_interpret_bwd_loop_forms(rows_per_iter, prefetch, stages, reload, rms):
    """Each backward loop form (one row; one row with the next row's loads issued first; one row in a loop
    Triton pipelines, which ignores prefetch; a [ROWS_PER_ITER, BLOCK_N] tile, which ignores both; the
    one-row loops re-reading the row after its reductions, which the tile ignores) against the reference
    grads. 37 rows over the interpreter's 4 programs: 10 rows each (12 with 4-row tiles), so the last
    program's rows end inside a tile or a pipelined loop runs past them, and each program's last prefetch
    falls past its rows."""
    config = adn.BwdConfig(8, 32, rows_per_iter, prefetch=prefetch, pipeline_stages=stages,
                           reload_rows=reload)
    for case in _BWD_VARIANT_CASES:
        _check_bwd_variant(config, 37, *case[:1], rms, *case[1:], expect_rows_per_iter=rows_per_iter,
                           expect_prefetch=prefetch and rows_per_iter == 1 and not stages,
                           expect_stages=stages if rows_per_iter == 1 else 0,
                           expect_reload=reload and rows_per_iter == 1)


@pytest.mark.interpret
@pytest.mark.usefixtures("interpreter")
def test_interpret_bwd_pipelined_wide_rows():
    """The pipelined loop at BLOCK_N >= 4096, where LayerNorm's two row sums share one reduction."""
    for rms in (False, True):
        _check_bwd_variant(adn.BwdConfig(16, 32, pipeline_stages=3), 9, 4000, rms, 0.2, True, True, not rms,
                           True, expect_stages=3)


@pytest.mark.interpret
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")
def test_interpret_bwd_tile_clamped_to_program_rows():
    """Fewer rows per program than the tile's height: the tile shrinks (5 rows over 4 programs: 2 each)."""
    _check_bwd_variant(adn.BwdConfig(8, 32, 4), 5, 40, False, 0.2, True, True, True, True,
                       expect_rows_per_iter=2)
    _check_bwd_variant(adn.BwdConfig(8, 32, 4), 1, 40, True, 0.2, True, True, False, True,
                       expect_rows_per_iter=1)


def test_bwd_config_table():
    """Every N has a shipped backward shape, and each is a legal one."""
    for rms in (False, True):
        for n in (1, 768, 1024, 1025, 4096, 8192, 8193, 16384, 16385, adn.MAX_N):
            cfg = adn.bwd_config(n, rms)
            assert isinstance(cfg, adn.BwdConfig)
            for v in (cfg.elems_per_thread, cfg.rows_per_iter, cfg.max_fused):
                assert v >= 1 and v & (v - 1) == 0, (n, rms, cfg)
            assert cfg.max_fused >= 16 and cfg.warps_per_sm >= 1
            # Triton pipelines the row loads only when it can prove N % 16 == 0
            assert not cfg.pipeline_stages or n % 16 == 0, (n, rms, cfg)
    assert adn.bwd_config(4096, False).pipeline_stages and not adn.bwd_config(4090, False).pipeline_stages
    # fp32 rows of 4096 columns would need ~190 KB of shared memory in RMSNorm's 4 stages: the unpipelined
    # shape
    assert adn.bwd_config(4096, True).pipeline_stages == 4
    assert not adn.bwd_config(4096, True, row_bytes=12).pipeline_stages


# ----------------------------------------------------------------------------------------------------------
# CUDA
# ----------------------------------------------------------------------------------------------------------

CUDA_NS = [1, 7, 97, 768, 1000, 1025, 3000, 4096, 8192, 12000, 65536]


@pytest.mark.cuda
@pytest.mark.parametrize("n", CUDA_NS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
def test_cuda_fwd_bwd_vs_fp64(n, dtype, rms):
    rows = max(2, min(2048, (1 << 22) // n)) + 3
    p = 0.1
    x, r, w, b = _inputs((rows, n), dtype, "cuda", bias=not rms, requires_grad=True)
    torch.manual_seed(n)
    seed = _seed("cuda")
    keep = dropout_keep_mask(seed, rows, n, p)
    torch.manual_seed(n)
    out, h = add_dropout_norm(x, r, w, b, dropout_p=p, is_rms_norm=rms, return_residual=True)
    ref_out, ref_h = _eager(x, r, w, b, keep, p, 1e-5, rms, upcast=True)
    lp_out, lp_h = _eager(x, r, w, b, keep, p, 1e-5, rms)
    assert _max_err(out, ref_out) <= 2 * _max_err(lp_out, ref_out) + FLOOR[dtype]
    assert _max_err(h, ref_h) <= 2 * _max_err(lp_h, ref_h) + FLOOR[dtype]
    dout, dh = torch.randn_like(out), torch.randn_like(h)
    params = [t for t in (x, r, w, b) if t is not None]
    grads = torch.autograd.grad((out * dout).sum() + (h * dh).sum(), params)
    ref_grads = torch.autograd.grad((ref_out * dout.double()).sum() + (ref_h * dh.double()).sum(), params)
    lp_grads = torch.autograd.grad((lp_out * dout).sum() + (lp_h * dh).sum(), params)
    for name, g, rg, lg in zip("xrwb"[: len(grads)], grads, ref_grads, lp_grads, strict=True):
        # dW sums over rows: scale the floor by the row count's sqrt.
        floor = FLOOR[dtype] * (rows**0.5 if name in "wb" else 1) * 4
        assert _max_err(g, rg) <= 2 * _max_err(lg, rg) + floor, (name, _max_err(g, rg), _max_err(lg, rg))


@pytest.mark.cuda
def test_cuda_matches_cpu_reference():
    x, r, w, b = _inputs((64, 1000), torch.float32, "cuda")
    seed = _seed("cuda")
    got = torch.ops.flash.add_dropout_norm_fwd(x, r, w, b, seed, 1e-5, 0.3, False, False, True)
    ref = adn._fwd_cpu(x.cpu(), r.cpu(), w.cpu(), b.cpu(), seed.cpu(), 1e-5, 0.3, False, False, True)
    assert torch.equal(got[1].cpu() == 0, ref[1] == 0)  # same dropout mask bit for bit
    torch.testing.assert_close(got[0].cpu(), ref[0], atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("case", _OPCHECK_CASES)
def test_opcheck_cuda(case):
    _opcheck(case, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_statistics_cuda(p):
    _check_dropout_statistics(p, "cuda", (4096, 4096))


@pytest.mark.cuda
def test_cuda_graph_capture():
    x, r, w, b = _inputs((128, 768), torch.bfloat16, "cuda")
    torch.manual_seed(0)
    add_dropout_norm(x, r, w, b, dropout_p=0.1)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = add_dropout_norm(x, r, w, b, dropout_p=0.1)
    g.replay()
    first = out.clone()
    g.replay()
    assert not torch.equal(first, out)  # the seed advances with the graph's generator offset


@pytest.mark.cuda
@pytest.mark.parametrize("rms", [False, True])
def test_cuda_inductor_fullgraph(rms):
    """Inductor inlines the triton_op's kernels; forward and backward match the eager call."""
    x, r, w, b = _inputs((257, 1000), torch.bfloat16, "cuda", bias=not rms, requires_grad=True)
    params = [t for t in (x, r, w, b) if t is not None]

    def f(*params, p=0.0):
        out, h = add_dropout_norm(*params, dropout_p=p, is_rms_norm=rms, return_residual=True)
        return out.float().square().sum() + h.float().sum()

    expected = torch.autograd.grad(f(*params), params)
    compiled = torch.compile(f, fullgraph=True)
    got = torch.autograd.grad(compiled(*params), params)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)
    torch.autograd.grad(compiled(*params, p=0.2), params)  # dropout traces and runs too


# Backward launch shapes of the sweep (bench_layer_norm.py --sweep-bwd) that take code paths the shipped shape
# does not: tiles of 2 and 4 rows, 16 elements per thread, rows fused up to 16384 columns (N=12000), and rows
# re-read after their reductions.
_CUDA_BWD_CONFIGS = [(8, 16, 2), (16, 16, 2), (8, 16, 4), (16, 32, 1), (16, 32, 1, 16384), (32, 16, 1, 16384),
                     (16, 32, 2, 16384), adn.BwdConfig(8, 16, pipeline_stages=3),
                     adn.BwdConfig(16, 32, pipeline_stages=2), adn.BwdConfig(8, 16, reload_rows=True),
                     adn.BwdConfig(32, 16, 1, 16384, reload_rows=True),
                     adn.BwdConfig(16, 16, pipeline_stages=3, reload_rows=True)]


@pytest.mark.cuda
@pytest.mark.parametrize("config", _CUDA_BWD_CONFIGS, ids=str)
@pytest.mark.parametrize("rms", [False, True])
def test_cuda_bwd_variants(config, rms):
    """Each candidate backward shape against the reference grads on the GPU (odd M, masked columns, bf16)."""
    wide = adn.BwdConfig(*config).max_fused > adn._MAX_FUSED_N_BWD  # rows past 8192 columns in registers
    cases = [(12000, torch.float32)] if wide else [(97, torch.float32), (1000, torch.bfloat16),
                                                   (4096, torch.bfloat16)]
    for n, dtype in cases:
        rows = 1037 if n <= 4096 else 301
        _check_bwd_variant(config, rows, n, rms, 0.1, True, True, True, True, dtype=dtype, device="cuda")
        _check_bwd_variant(config, rows, n, rms, 0.0, False, True, False, False, dtype=dtype, device="cuda")

