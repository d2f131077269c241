"""The linear-group family (fx_passes/linear_group.py): F.linear calls on one input -> one F.linear over the
stacked weights, split. Checked through the rewrite-only backend against eager, forward and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers  # a test dependency, installed in CI (README)
from torch._dynamo.utils import counters

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting

D = 24


def _check(model, x, rewrites, skipped=0, text=None, dynamic=False):
    counters.clear()
    params = list(model.parameters())
    expected = model(x)
    e_grads = torch.autograd.grad(expected.square().sum(), [*params], allow_unused=True)
    with collecting() as report:
        got = torch.compile(model, backend=rewrite_only_backend, dynamic=dynamic)(x)
    g_grads = torch.autograd.grad(got.square().sum(), [*params], allow_unused=True)
    assert counters["flash"]["linear_group"] == rewrites, str(report)
    assert counters["flash"]["linear_group_skipped"] == skipped, str(report)
    if text is not None:
        assert text in str(report), str(report)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for e, g in zip(e_grads, g_grads, strict=True):
        if e is not None:
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


class QKV(nn.Module):
    """Separate q, k, v projections (BERT, ViT), k and v narrower as with GQA."""

    def __init__(self, bias=True, kv=D // 2):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D, bias), nn.Linear(D, kv, bias), nn.Linear(D, kv, bias)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, -1).transpose(1, 2)
        k = self.k(x).view(b, s, 2, -1).transpose(1, 2)
        v = self.v(x).view(b, s, 2, -1).transpose(1, 2)
        return (q.sum(1, keepdim=True) @ k.transpose(-1, -2) @ v).flatten(1)


class GatedMLP(nn.Module):
    """Llama's MLP: gate and up projections of one input, no bias."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = (nn.Linear(D, 40, bias=False), nn.Linear(D, 40, bias=False),
                                         nn.Linear(40, D, bias=False))

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("bias", [True, False])
def test_qkv_projections_are_stacked(bias):
    _check(QKV(bias), torch.randn(2, 7, D), rewrites=1)


def test_gated_mlp_and_dynamic_shapes():
    _check(GatedMLP(), torch.randn(3, 5, D), rewrites=1, dynamic=True)


def test_only_linears_with_the_same_bias_presence_are_stacked():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(D, 8), nn.Linear(D, 8), nn.Linear(D, 8, bias=False)

        def forward(self, x):
            return self.a(x) * self.b(x) + self.c(x)

    _check(Mixed(), torch.randn(4, D), rewrites=1)  # a and b; c has no partner


def test_a_linear_another_family_fuses_is_not_taken():
    class MLPAndGate(nn.Module):  # fc1 + GELU goes to the dense family; the gate stays alone
        def __init__(self):
            super().__init__()
            self.fc1, self.gate = nn.Linear(D, 32), nn.Linear(D, 32)

        def forward(self, x):
            return F.gelu(self.fc1(x)) * torch.sigmoid(self.gate(x))

    _check(MLPAndGate(), torch.randn(4, D), rewrites=0)
    assert counters["flash"]["dense"] == 1


def test_computed_weights_are_not_stacked():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(D, 8), nn.Linear(D, 8)

        def forward(self, x):
            return F.linear(x, self.a.weight * 2, self.a.bias) + F.linear(x, self.b.weight * 3, self.b.bias)

    _check(Scaled(), torch.randn(4, D), rewrites=0)


def test_a_view_that_needs_contiguous_output_is_a_near_miss():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(D, 8), nn.Linear(D, 8)

        def forward(self, x):
            return self.a(x).view(-1) * self.b(x).view(-1)  # flattening a column slice needs a copy

    _check(Flat(), torch.randn(3, 4, D), rewrites=0, skipped=1, text="cannot take")


@pytest.mark.parametrize("kind", ["bert", "vit"])
def test_transformers_attention_projections(kind):
    torch.manual_seed(0)
    common = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(vocab_size=101, **common))
        inputs = {"input_ids": torch.randint(0, 101, (2, 9))}
    else:
        model = transformers.ViTModel(transformers.ViTConfig(image_size=16, patch_size=8, **common))
        inputs = {"pixel_values": torch.randn(3, 3, 16, 16)}
    model.eval()
    counters.clear()
    expected = model(**inputs).last_hidden_state
    got = torch.compile(model, backend=rewrite_only_backend)(**inputs).last_hidden_state
    assert counters["flash"]["linear_group"] == 2  # q, k, v of each layer
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
