"""flash::linear_cross_entropy_*: the op against F.cross_entropy in fp64, its contract (opcheck, padded
logits, errors), the Triton kernels under the interpreter, and the CUDA paths on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

from flash_backend.ops import cross_entropy as ce
from flash_backend.ops.cross_entropy import linear_cross_entropy, padded_classes

HAS_CUDA = torch.cuda.is_available()
# The floor is relative to the largest exact value (a summed loss is in the hundreds).
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 1e-3}


def _problem(rows, k, classes, dtype, device="cpu", bias=True, ignored=(1,)):
    torch.manual_seed(rows * 7 + classes)
    x = torch.randn(rows, k, device=device, dtype=dtype)
    weight = (torch.randn(classes, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(classes, device=device, dtype=dtype) if bias else None
    target = torch.randint(0, classes, (rows,), device=device)
    target[[i for i in ignored if i < rows]] = -100
    return x, weight, b, target


def _eager(x, weight, bias, target, upcast, **kw):
    logits = F.linear(x, weight, bias)
    return F.cross_entropy(logits.float() if upcast else logits, target, **kw), logits


def _loss_and_grads(fn, x, weight, bias, target, grad_seed=0, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias) if t is not None]
    x_, w_, b_ = leaves[0], leaves[1], leaves[2] if bias is not None else None
    loss, logits = fn(x_, w_, b_, target, **kw)
    gen = torch.Generator(device=x.device).manual_seed(grad_seed)
    g_loss = torch.randn(loss.shape, device=x.device, generator=gen, dtype=loss.dtype)
    g_logits = torch.randn(logits.shape, device=x.device, generator=gen, dtype=logits.dtype) * 0.01
    grads = torch.autograd.grad([loss, logits], leaves, [g_loss, g_logits])
    return [loss, logits, *grads]


def _ours(x, weight, bias, target, upcast, **kw):
    return linear_cross_entropy(x, weight, bias, target, loss_dtype=torch.float32 if upcast else None, **kw)


def _assert_within_twice_eager_error(x, weight, bias, target, upcast=False, **kw):
    """Our loss, logits and gradients are at most 2x eager's own error against fp64 (+ a floor)."""
    exact = _loss_and_grads(_eager, x.double(), weight.double(), bias.double() if bias is not None else None,
                            target, upcast=False, **kw)
    eager = _loss_and_grads(_eager, x, weight, bias, target, upcast=upcast, **kw)
    ours = _loss_and_grads(_ours, x, weight, bias, target, upcast=upcast, **kw)
    names = ["loss", "logits", "grad_x", "grad_weight", "grad_bias"]
    for name, e, o, r in zip(names[:len(eager)], eager, ours, exact, strict=True):
        assert o.dtype == e.dtype and o.shape == e.shape, name
        err_eager = (e.double() - r).abs().max().item()
        err_ours = (o.double() - r).abs().max().item()
        floor = FLOOR[x.dtype] * max(1.0, r.abs().max().item())
        assert err_ours <= 2 * err_eager + floor, (name, err_ours, err_eager)


# ------------------------------------------------------------------------------------- reference (CPU)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_cross_entropy(reduction, label_smoothing, dtype):
    x, weight, bias, target = _problem(97, 24, 37, dtype, ignored=(1, 50))
    _assert_within_twice_eager_error(x, weight, bias, target, reduction=reduction,
                                     label_smoothing=label_smoothing)


@pytest.mark.parametrize("upcast", [False, True])
def test_leading_dims_no_bias_custom_ignore_index(upcast):
    torch.manual_seed(0)
    x = torch.randn(3, 13, 16, dtype=torch.bfloat16)
    weight = torch.randn(1000, 16, dtype=torch.bfloat16) / 4
    target = torch.randint(0, 1000, (39,))
    target[:5] = 7  # ignore_index inside [0, classes)
    loss, logits = linear_cross_entropy(x, weight, None, target, ignore_index=7,
                                        loss_dtype=torch.float32 if upcast else None)
    assert logits.shape == (3, 13, 1000) and logits.stride() == (13 * 1000, 1000, 1)
    eager, _ = _eager(x.reshape(-1, 16), weight, None, target, upcast, ignore_index=7)
    assert loss.dtype == eager.dtype
    exact = F.cross_entropy(F.linear(x.double(), weight.double()).reshape(-1, 1000), target, ignore_index=7)
    assert (loss.double() - exact).abs() <= 2 * (eager.double() - exact).abs() + 1e-2


def test_logits_rows_are_padded():
    x, weight, bias, target = _problem(5, 8, 37, torch.float32)
    loss, logits = linear_cross_entropy(x, weight, bias, target)
    assert logits.shape == (5, 37) and logits.stride() == (padded_classes(37), 1) == (40, 1)
    torch.testing.assert_close(logits, F.linear(x, weight, bias))


def test_every_row_ignored_gives_nan_mean_like_eager():
    x, weight, bias, target = _problem(4, 8, 11, torch.float32)
    target.fill_(-100)
    loss, _ = linear_cross_entropy(x, weight, bias, target)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(F.linear(x, weight, bias), target))
    x.requires_grad_()
    loss, _ = linear_cross_entropy(x, weight, bias, target, reduction="sum")
    (grad_x,) = torch.autograd.grad(loss, x)
    assert loss.item() == 0.0 and torch.count_nonzero(grad_x) == 0


def test_unused_logits_output_needs_no_gradient():
    x, weight, bias, target = _problem(6, 8, 11, torch.float32)
    x.requires_grad_()
    loss, _ = linear_cross_entropy(x, weight, bias, target)
    (ours,) = torch.autograd.grad(loss, x)
    x2 = x.detach().clone().requires_grad_()
    (eager,) = torch.autograd.grad(F.cross_entropy(F.linear(x2, weight, bias), target), x2)
    torch.testing.assert_close(ours, eager)


# ------------------------------------------------------------------------------------------ contract


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.25])
def test_opcheck(bias, label_smoothing):
    x, weight, b, target = _problem(9, 16, 37, torch.float32, bias=bias)
    for t in (x, weight, b):
        if t is not None:
            t.requires_grad_()
    opcheck(torch.ops.flash.linear_cross_entropy_fwd, (x, weight, b, target, -100, label_smoothing))
    x_strided = torch.randn(16, 9).t()  # a transposed (non-contiguous) x
    opcheck(torch.ops.flash.linear_cross_entropy_fwd, (x_strided, weight, b, target, -100, label_smoothing))
    logits, _, lse = torch.ops.flash.linear_cross_entropy_fwd(x, weight, b, target, -100, label_smoothing)
    grad_loss = torch.randn(9)
    for grad_logits in (None, torch.randn(9, 37)):
        opcheck(torch.ops.flash.linear_cross_entropy_bwd,
                (grad_loss, grad_logits, x.detach(), weight.detach(), logits.detach(), lse, target, -100,
                 label_smoothing, bias))


def test_bad_input_is_named():
    x, weight, bias, target = _problem(4, 8, 11, torch.float32)
    with pytest.raises(TypeError, match="target must hold class indices"):
        linear_cross_entropy(x, weight, bias, target.float())
    with pytest.raises(ValueError, match=r"target must have shape \(M,\) = \(4,\)"):
        linear_cross_entropy(x, weight, bias, target[:3])
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(x, weight[:, :5], bias, target)
    with pytest.raises(ValueError, match="bias must have shape"):
        linear_cross_entropy(x, weight, bias[:4], target)
    with pytest.raises(TypeError, match="weight dtype"):
        linear_cross_entropy(x, weight.double(), bias, target)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        linear_cross_entropy(x, weight, bias, target, label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction must be one of"):
        linear_cross_entropy(x, weight, bias, target, reduction="batchmean")
    target[2] = 11
    with pytest.raises(IndexError, match=r"outside \[0, 11\)"):
        linear_cross_entropy(x, weight, bias, target)
    # Traced, the op's body runs the reference without its data-dependent range check: the gather of the
    # out-of-range class must still raise, not return a loss.
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, t: linear_cross_entropy(x, weight, bias, t)[0], backend="aot_eager",
                             fullgraph=True)
    with pytest.raises(RuntimeError, match="out of bounds"):
        compiled(x, target)


# ---------------------------------------------------------------------- Triton kernels, interpreter


def _padded_logits(rows, classes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = ce._empty_logits(rows, classes, torch.empty(0, dtype=dtype))
    logits.copy_(torch.randn(rows, classes, generator=gen) * 4)
    return logits


def _reference_rows(logits, target, ignore_index, label_smoothing):
    z = logits.float()
    lse = torch.logsumexp(z, -1)
    keep = target != ignore_index
    picked = z.gather(1, torch.where(keep, target, 0)[:, None])[:, 0]
    loss = lse - (1 - label_smoothing) * picked - label_smoothing * z.mean(-1)
    return torch.where(keep, loss, 0.0), torch.where(keep, lse, 0.0)  # ignored rows: lse 0 by contract


@pytest.mark.interpret
@pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
@pytest.mark.parametrize("block", [None, 16])  # None: one chunk per row; 16: several, the last partial
def test_interpret_kernels(monkeypatch, dtype, label_smoothing, block):
    if block is not None:  # and backward programs of 3 rows each: 7 rows end inside the last program's group
        monkeypatch.setattr(ce, "_fwd_config", lambda classes: (block, 1))
        monkeypatch.setattr(ce, "_bwd_config", lambda classes: (block, 1, 3))
    rows, classes = 7, 37
    logits = _padded_logits(rows, classes, dtype)
    logits[2, :30] = float("-inf")  # a row whose lanes mostly see only -inf
    target = torch.randint(0, classes, (rows,), generator=torch.Generator().manual_seed(1))
    target[1], target[2], target[4] = -100, 31, 0
    logits[1] = float("nan")  # the ignored row's logits are never read: NaN would show in its loss or grad
    loss, lse = ce.cross_entropy_fwd_launch(logits, target, -100, label_smoothing)
    ref_loss, ref_lse = _reference_rows(logits, target, -100, label_smoothing)
    torch.testing.assert_close(lse, ref_lse)
    finite = torch.isfinite(ref_loss)  # with smoothing, row 2's mean over -inf logits is -inf, in both
    torch.testing.assert_close(loss[finite], ref_loss[finite])
    assert torch.equal(torch.isinf(loss), torch.isinf(ref_loss)) and loss[1] == 0

    grad_loss = torch.randn(rows)
    for grad_logits in (None, torch.randn(rows, classes)):
        padded, grad_bias = ce.cross_entropy_bwd_launch(grad_loss, grad_logits, logits, lse, target, -100,
                                                        label_smoothing, bias_grad=True)
        expected = ce._grad_logits_reference(grad_loss, grad_logits, logits, ref_lse, target, -100,
                                             label_smoothing)
        assert padded.dtype == dtype and padded.shape == (rows, padded_classes(classes)) == (rows, 40)
        assert torch.count_nonzero(padded[:, classes:]) == 0  # the GEMMs read the padding: it must be 0
        grad = padded[:, :classes]
        torch.testing.assert_close(grad_bias, grad.float().sum(0))  # the column sums of what was stored
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(grad.float(), expected, atol=tol, rtol=tol)
        if grad_logits is None:  # the ignored row: exactly 0, also where its softmax is not finite
            assert torch.count_nonzero(grad[1]) == 0


@pytest.mark.interpret
@pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only machines")
def test_interpret_out_of_range_target_is_nan_and_broadcast_grad_loss():
    logits = _padded_logits(3, 10, torch.float32)
    target = torch.tensor([4, 10, -1])
    loss, lse = ce.cross_entropy_fwd_launch(logits, target, -100, 0.0)
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1:]).all()
    grad_loss = torch.full((1,), 0.5).expand(3)  # what autograd hands back from a mean: stride 0
    target = target[:1].expand(3).contiguous()
    grad = ce.cross_entropy_bwd_launch(grad_loss, None, logits, lse, target, -100, 0.0)[0][:, :10]
    expected = ce._grad_logits_reference(grad_loss, None, logits, lse, target, -100, 0.0)
    torch.testing.assert_close(grad, expected)


# ----------------------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1000, 768, 30522), (333, 64, 1000), (257, 60, 50257)])
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_matches_cross_entropy(dtype, shape, bias):
    rows, k, classes = shape  # K = 60: the PyTorch-GEMM path; the others cuBLASLt
    x, weight, b, target = _problem(rows, k, classes, dtype, device="cuda", bias=bias, ignored=(1, 5, 200))
    for upcast in (False, True):
        _assert_within_twice_eager_error(x, weight, b, target, upcast=upcast,
                                         label_smoothing=0.1 if bias else 0.0)


@pytest.mark.cuda
def test_cuda_fp32_and_padding():
    x, weight, bias, target = _problem(100, 32, 30522, torch.float32, device="cuda")
    _assert_within_twice_eager_error(x, weight, bias, target, reduction="sum")
    x, weight, bias, target = _problem(100, 32, 30522, torch.bfloat16, device="cuda")
    _, logits = linear_cross_entropy(x, weight, bias, target)
    assert logits.stride() == (30528, 1)


@pytest.mark.cuda
def test_cuda_opcheck():
    x, weight, bias, target = _problem(64, 128, 999, torch.bfloat16, device="cuda")
    for t in (x, weight, bias):
        t.requires_grad_()
    opcheck(torch.ops.flash.linear_cross_entropy_fwd, (x, weight, bias, target, -100, 0.1))
    logits, _, lse = torch.ops.flash.linear_cross_entropy_fwd(x, weight, bias, target, -100, 0.1)
    grad_loss = torch.randn(64, device="cuda")
    opcheck(torch.ops.flash.linear_cross_entropy_bwd,
            (grad_loss, None, x.detach(), weight.detach(), logits.detach(), lse, target, -100, 0.1, True))


@pytest.mark.cuda
def test_cuda_out_of_range_target_is_nan():
    x, weight, bias, target = _problem(8, 64, 100, torch.bfloat16, device="cuda")
    target[3] = 100
    loss, _ = linear_cross_entropy(x, weight, bias, target, reduction="none")
    assert torch.isnan(loss[3]) and torch.isfinite(loss[torch.arange(8, device="cuda") != 3]).all()


@pytest.mark.cuda
def test_cuda_compiled_head_matches_eager():
    """A Linear + cross-entropy head under torch.compile(backend="flash") on CUDA: the rewrite fires and
    the traced triton_op bodies (the loss passes launched by Inductor, the GEMMs as extern kernels) give
    eager's loss and gradients within bf16 noise; odd class count, ignored rows, label smoothing."""
    from fx_passes._compat import counters

    torch.manual_seed(0)
    head = torch.nn.Linear(96, 1003, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 37, 96, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, 1003, (4, 37), device="cuda")
    target[0, :5] = -100

    def loss_fn(h):
        logits = head(h)
        return F.cross_entropy(logits.view(-1, 1003), target.view(-1), label_smoothing=0.1)

    def loss_and_grads(fn):
        h = x.clone().requires_grad_()
        head.zero_grad(set_to_none=True)
        loss = fn(h)
        loss.backward()
        return [loss.float(), h.grad.float(), head.weight.grad.float(), head.bias.grad.float()]

    want = loss_and_grads(loss_fn)
    # the fp32 reference of the same head
    head32 = torch.nn.Linear(96, 1003, device="cuda").requires_grad_()
    with torch.no_grad():
        head32.weight.copy_(head.weight)
        head32.bias.copy_(head.bias)
    h32 = x.float().requires_grad_()
    loss32 = F.cross_entropy(head32(h32).view(-1, 1003), target.view(-1), label_smoothing=0.1)
    loss32.backward()
    exact = [loss32, h32.grad, head32.weight.grad, head32.bias.grad]
    counters.clear()
    torch._dynamo.reset()
    got = loss_and_grads(torch.compile(loss_fn, backend="flash", fullgraph=True))
    assert counters["flash"]["cross_entropy"] == 1, dict(counters["flash"])
    for name, g, w, e in zip(("loss", "grad_x", "grad_weight", "grad_bias"), got, want, exact, strict=True):
        ours, eager = (g - e).abs().max().item(), (w - e).abs().max().item()
        assert ours <= 2 * eager + 1e-2, (name, ours, eager)
