"""The cross-entropy family pass (fx_passes/cross_entropy.py): F.cross_entropy over a Linear's logits ->
flash linear_cross_entropy.

Heads as models write them (nn.CrossEntropyLoss on a view, transformers' causal-LM loss with its fp32
upcast and shifted labels, a classifier), checked through the rewrite-only backend (dynamo + the pass, run
as plain PyTorch) against eager in training and inference; transformers GPT-2 / BERT / ViT heads; and the
near misses, each left alone with its reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers  # a test dependency, installed in CI (README)
from torch._dynamo.utils import counters

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting

K, V = 16, 37


class Head(nn.Module):
    """A language-model head: Linear to V classes, the loss written by `loss_fn(logits, labels)`."""

    def __init__(self, loss_fn, bias=True, classes=V):
        super().__init__()
        self.proj = nn.Linear(K, classes, bias=bias)
        self.loss_fn = loss_fn

    def forward(self, x, labels):
        logits = self.proj(x)
        return self.loss_fn(logits, labels), logits


def module_loss(logits, labels):  # BERT's MLM head
    return nn.CrossEntropyLoss()(logits.view(-1, logits.shape[-1]), labels.view(-1))


def causal_lm_loss(logits, labels, ignore_index=-100):  # transformers' ForCausalLMLoss
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous()
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), shift_labels.view(-1),
                           ignore_index=ignore_index, reduction="sum")
    return loss / (shift_labels != ignore_index).sum()


def smoothed_flatten_loss(logits, labels):
    return F.cross_entropy(torch.flatten(logits, 0, 1).contiguous(), labels.reshape(-1), label_smoothing=0.2,
                           ignore_index=0)


def per_token_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, V), labels.flatten(), reduction="none").view(labels.shape)


def _run(model, args, train):
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.set_grad_enabled(train):
        loss, logits = model(*args)
    if not train:
        return [loss, logits]
    gen = torch.Generator().manual_seed(0)  # the same output gradients for eager and compiled
    g_loss = torch.randn(loss.shape, generator=gen)
    g_logits = torch.randn(logits.shape, generator=gen) * 0.1  # the logits are used too: their gradient flows
    return [loss, logits, *torch.autograd.grad([loss, logits], params, [g_loss, g_logits])]


def _check(model, args, rewrites=1, train=True, skipped=0):
    counters.clear()
    expected = _run(model, args, train)
    with collecting() as report:
        got = _run(torch.compile(model, backend=rewrite_only_backend, fullgraph=True), args, train)
    assert counters["flash"]["cross_entropy"] == rewrites, str(report)
    assert counters["flash"]["cross_entropy_skipped"] == skipped, str(report)
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    return report


def _labels(shape, classes=V, ignore=-100):
    labels = torch.randint(1, classes, shape)
    labels.view(-1)[::5] = ignore
    return labels


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("loss_fn", [module_loss, causal_lm_loss, smoothed_flatten_loss, per_token_loss])
def test_heads_are_rewritten(loss_fn, train):
    labels = _labels((3, 7), ignore=0 if loss_fn is smoothed_flatten_loss else -100)
    report = _check(Head(loss_fn), (torch.randn(3, 7, K), labels), train=train)
    if loss_fn is causal_lm_loss:
        assert "float -> view -> F.cross_entropy" in str(report)


def test_classifier_without_bias_on_2d_input():
    def loss_fn(logits, labels):
        return F.cross_entropy(logits, labels)

    _check(Head(loss_fn, bias=False, classes=10), (torch.randn(9, K), torch.randint(0, 10, (9,))))


def test_dynamic_batch_does_not_recompile():
    model = Head(module_loss)
    compiled = torch.compile(model, backend=rewrite_only_backend, dynamic=True)
    for batch in (2, 5):
        x, labels = torch.randn(batch, 7, K), _labels((batch, 7))
        torch.testing.assert_close(compiled(x, labels)[0], model(x, labels)[0])
    assert counters["flash"]["cross_entropy"] == 1


# ------------------------------------------------------------------------------------------ near misses


def _not_rewritten(loss_fn, reason, classes=V, labels=None, x=None):
    x = torch.randn(3, 7, K) if x is None else x
    labels = _labels((3, 7), classes) if labels is None else labels
    report = _check(Head(loss_fn, classes=classes), (x, labels), rewrites=0, skipped=1)
    assert reason in str(report), str(report)


def test_class_weights_are_left_alone():
    weights = torch.rand(V)
    _not_rewritten(lambda lg, y: F.cross_entropy(lg.view(-1, V), y.view(-1), weight=weights), "class weights")


def test_class_dim_other_than_last_is_left_alone():
    # (N, C, d) input: F.cross_entropy's class dimension is 1. The Linear's vocabulary moved there by
    # transpose(1, 2) is fused (tests/test_ce_dense_forms_s31.py); moved to dim 0 it is another function.
    _not_rewritten(lambda lg, y: F.cross_entropy(lg.transpose(0, 2), y), "permutes the logits' dimensions",
                   labels=torch.randint(0, 7, (V, 3)))


def test_probability_targets_are_left_alone():
    _not_rewritten(lambda lg, y: F.cross_entropy(lg.view(-1, V), y.view(-1, V).softmax(-1)), "not (M,) int64",
                   labels=torch.randn(3, 7, V))


def test_logits_sliced_along_classes_are_left_alone():
    # A slice of the classes is a loss over fewer classes than the Linear's. (A slice of rows, the older
    # GPT-2 shift logits[..., :-1, :], is rewritten: tests/test_ce_dense_more_forms_s23.py.)
    def sliced(lg, y):
        return F.cross_entropy(lg[..., :-1, 1:].contiguous().view(-1, V - 1), y[..., 1:].reshape(-1))

    _not_rewritten(sliced, "getitem", labels=torch.randint(0, V - 1, (3, 7)))


def test_downcast_logits_are_left_alone():
    _not_rewritten(lambda lg, y: F.cross_entropy(lg.half().float().view(-1, V), y.view(-1)), "half")


def test_input_written_in_place_before_the_loss_is_left_alone():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(K, V)

        def forward(self, x, labels):
            logits = self.proj(x)
            x.mul_(2.0)  # after the Linear read x; the fused op would sit after the target below, and read 2x
            target = labels.view(-1)
            return F.cross_entropy(logits.view(-1, V), target), logits

    model, x, labels = InPlace(), torch.randn(3, 7, K), _labels((3, 7))
    with torch.no_grad():
        expected = model(x.clone(), labels)
        counters.clear()
        with collecting() as report:
            got = torch.compile(model, backend=rewrite_only_backend)(x.clone(), labels)
    assert counters["flash"]["cross_entropy"] == 0 and "written in place" in str(report), str(report)
    torch.testing.assert_close(got, expected)


def test_logits_not_from_a_linear_are_left_alone():
    def scaled(lg, y):
        return F.cross_entropy((lg * 0.5).view(-1, V), y.view(-1))

    _not_rewritten(scaled, "mul")


# -------------------------------------------------------------------------------------- transformers


def _tiny(kind):
    common = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=101, n_positions=32)
        model = transformers.GPT2LMHeadModel(cfg)
        # Without a recognised loss_type transformers logs a warning inside the forward, where dynamo breaks
        # the graph: the loss then lands in a graph of its own (test_logits_from_another_graph_...).
        model.loss_type = "ForCausalLM"
        ids = torch.randint(0, 101, (2, 9))
        return model, {"input_ids": ids, "labels": ids}
    if kind == "bert":
        model = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=101, **common))
        ids = torch.randint(0, 101, (2, 9))
        return model, {"input_ids": ids, "labels": ids.masked_fill(torch.rand(2, 9) < 0.3, -100)}
    cfg = transformers.ViTConfig(image_size=16, patch_size=8, num_labels=10, **common)
    model = transformers.ViTForImageClassification(cfg)
    return model, {"pixel_values": torch.randn(3, 3, 16, 16), "labels": torch.randint(0, 10, (3,))}


@pytest.mark.parametrize("kind", ["gpt2", "bert", "vit"])
def test_transformers_heads(kind):
    torch.manual_seed(0)
    model, inputs = _tiny(kind)
    model.eval()  # no dropout, so eager and compiled compare exactly
    counters.clear()
    expected = model(**inputs)
    expected_grads = torch.autograd.grad(expected.loss, list(model.parameters()), allow_unused=True)
    with collecting() as report:
        got = torch.compile(model, backend=rewrite_only_backend)(**inputs)
        grads = torch.autograd.grad(got.loss, list(model.parameters()), allow_unused=True)
    assert counters["flash"]["cross_entropy"] == 1, str(report)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    for e, g in zip(expected_grads, grads, strict=True):
        if e is not None:
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)


def check_end_to_end_through_inductor(loss):
    """A Head with this loss, compiled by the flash backend through Inductor: one rewrite, eager's results."""
    torch.manual_seed(0)
    model = Head(loss)
    x, labels = torch.randn(2, 5, K), _labels((2, 5))
    expected = _run(model, (x, labels), True)
    counters.clear()
    got = _run(torch.compile(model, backend="flash"), (x, labels), True)
    assert counters["flash"]["cross_entropy"] == 1
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_end_to_end_through_inductor():
    check_end_to_end_through_inductor(causal_lm_loss)


def test_logits_from_another_graph_are_left_alone():
    model = Head(causal_lm_loss)

    def forward(x, labels):
        logits = model.proj(x)
        torch._dynamo.graph_break()  # as transformers' loss_function warning does for GPT-2 by default
        return causal_lm_loss(logits, labels), logits

    counters.clear()
    x, labels = torch.randn(2, 5, K), _labels((2, 5))
    with collecting() as report:
        torch.compile(forward, backend=rewrite_only_backend)(x, labels)
    assert counters["flash"]["cross_entropy"] == 0, str(report)
    assert "an input of this graph" in str(report), str(report)


@pytest.mark.parametrize("loss_fn", [module_loss, causal_lm_loss], ids=["module_loss", "causal_lm_loss"])
def test_head_under_autocast_is_rewritten(loss_fn):
    """Under CPU bf16 autocast: fused on the operands cast as autocast casts them (review s35b M1). The
    loss, the bf16 logits and the fp32 parameters' gradients are eager's autocast run's."""
    torch.manual_seed(0)
    model = Head(loss_fn)
    args = (torch.randn(2, 5, K), _labels((2, 5)))
    counters.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _run(model, args, True)
        with collecting() as report:
            got = _run(torch.compile(model, backend=rewrite_only_backend, fullgraph=True), args, True)
    assert counters["flash"]["cross_entropy"] == 1, str(report)
    assert "autocast to bfloat16" in str(report), str(report)
    assert got[1].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in got[2:])
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, atol=1e-2, rtol=1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_head_under_autocast_with_the_flash_backend(dtype):
    """The autocast LM head through backend="flash" on the GPU kernels (cuBLASLt forward, Triton passes):
    loss, logits and the fp32 parameters' gradients as eager's autocast run."""
    torch.manual_seed(0)
    model = Head(causal_lm_loss, classes=294).cuda()  # not a multiple of 8: the op's rows padded to 296
    x = torch.randn(4, 33, K, device="cuda")
    labels = torch.randint(0, model.proj.out_features, (4, 33), device="cuda")
    params = list(model.parameters())

    def step(fn):
        with torch.autocast("cuda", dtype=dtype):
            loss, logits = fn(x, labels)
        grads = torch.autograd.grad([loss, logits], params,
                                    [torch.ones_like(loss), 0.1 * torch.ones_like(logits)])
        return [loss, logits, *grads]

    counters.clear()
    expected = step(model)
    with collecting() as report:
        got = step(torch.compile(model, backend="flash", fullgraph=True))
    assert counters["flash"]["cross_entropy"] == 1, str(report)
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g.float(), e.float(), atol=2e-2, rtol=2e-2)
