"""A node nobody reads is no other user (review s32, finding A2; fx_passes/_match.py erase_dead_code).

openai/whisper's qkv_attention returns ``(out, qk.detach())`` and its block keeps ``[0]``: dynamo leaves the
detach in the graph without users, and the attention pass took it for another user of the scores. The dense
pass had the same blind spot (a dead ``h.detach()`` / ``h.float()`` of the pre-activation), and so did the
norm and cross-entropy passes when run alone (a dead reader of a hand-written norm's variance, of the
log-probabilities). Each family now erases the pure nodes nobody reads before it matches. What still counts,
tested here: a live other user, and a dead node that acts (an in-place write, a random op).

Compiled with the rewrite-only backend (or one family alone), compared with eager in training (outputs and
the gradients of every input and parameter) and eval, fp32, on fresh random inputs; dynamic=True too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_codebases_review_s31 import TOL
from test_norm_dense_ce_review_s25 import _run

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting, run_passes
from fx_passes._compat import counters
from fx_passes._match import erase_dead_code
from fx_passes._report import committed_only

R = torch.randn


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _only(family):
    """A backend running one family alone (run_passes(families=...)), then the graph as plain PyTorch."""

    def backend(gm, example_inputs):
        with committed_only():
            run_passes(gm.graph, families={family})
        return gm.forward

    return backend


def _check(model, argsets, rewrites, near_miss=None, backend=rewrite_only_backend, dynamic=False):
    """Training and eval, one compile each over every argument set: eager's results, the rewrites per
    family ({family: n}, the others 0) and, when given, one near miss whose reason holds near_miss."""
    for train in (True, False):
        model.train(train)
        torch._dynamo.reset()
        counters.clear()
        with collecting() as report:
            compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
            for args in argsets:
                got, want = _run(compiled, args, train), _run(model, args, train)
                assert len(got) == len(want), str(report)
                for g, w in zip(got, want, strict=True):
                    torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"{m}\n{report}")
        assert report.counts() == rewrites, f"{train=}: {report}"
        if near_miss is None:
            assert not report.near_misses, str(report)
        else:
            assert [near_miss in d.detail for d in report.near_misses] == [True], str(report)


# ========================================================================================================
# The helper: what erase_dead_code erases and what it keeps
# ========================================================================================================


def _graph_after_erasing(fn, *args):
    """The targets (op names) of the call nodes left in fn's dynamo graph after erase_dead_code."""
    left = []

    def backend(gm, example_inputs):
        erase_dead_code(gm.graph)
        gm.recompile()
        left.extend(str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes
                    if n.op in ("call_function", "call_method"))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return left


def test_dead_pure_nodes_are_erased_with_what_only_they_read():
    def fn(x):
        h = x * 2
        h.detach().float().view(-1)  # a dead chain
        (h + 1).softmax(-1)
        return h.sin()

    assert _graph_after_erasing(fn, R(3, 5)) == ["mul", "sin"]


def test_live_and_acting_nodes_are_kept():
    def fn(x, buf):
        h = x * 2
        h.detach().add_(1)  # a write into h's memory, read by nothing after: it still writes h
        torch.rand_like(h)  # draws from the generator: later random ops see the state it leaves
        F.dropout(h, 0.5, training=True)
        torch.add(h, 1, out=buf)
        return h.cos(), h.detach()

    left = _graph_after_erasing(fn, R(3, 5), torch.empty(3, 5))
    for kept in ("add_", "rand_like", "dropout", "add", "cos", "detach"):
        assert kept in left, left


# ========================================================================================================
# Attention (finding A2): whisper's dropped qk.detach()
# ========================================================================================================


class _ManualAttention(nn.Module):
    """openai/whisper's MultiHeadAttention.qkv_attention on its manual path, the block keeping [0] of
    (out, qk.detach()). live: the detached scores are returned too (a real other user: refused).
    write: the detached scores are scaled in place before the softmax reads them (a dead node that acts:
    eager's softmax sees the doubled scores)."""

    def __init__(self, dim=24, heads=3, use="dead"):
        super().__init__()
        self.heads, self.use = heads, use
        self.query, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, dim)

    def qkv_attention(self, q, k, v):
        scale = (q.shape[-1] // self.heads) ** -0.25
        q, k, v = (t.view(*t.shape[:2], self.heads, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        qk = (q * scale) @ (k * scale).transpose(-1, -2)
        if self.use == "write":
            qk.detach().mul_(2)
        w = F.softmax(qk.float(), dim=-1).to(q.dtype)
        return (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2), qk.detach()

    def forward(self, x):
        out, qk = self.qkv_attention(self.query(x), self.key(x), self.value(x))
        return (self.out(out), qk) if self.use == "live" else self.out(out)


def test_a_dead_detach_of_the_scores_is_no_other_user():
    _check(_ManualAttention(), [(R(2, 7, 24),)], {"attention": 1})


def test_a_dead_detach_of_the_scores_under_dynamic_shapes():
    _check(_ManualAttention(), [(R(2, s, 24),) for s in (7, 10, 13)], {"attention": 1}, dynamic=True)


def test_a_live_detach_of_the_scores_still_blocks_the_rewrite():
    _check(_ManualAttention(use="live"), [(R(2, 7, 24),)], {}, near_miss="has other users")


def test_a_dead_write_into_the_scores_still_counts():
    """The write has no user but changes what the softmax reads: not erased, the pattern left alone."""
    _check(_ManualAttention(use="write"), [(R(2, 7, 24),)], {}, near_miss="qk")


# ========================================================================================================
# Dense: a dead reader of the Linear's output (the pre-activation)
# ========================================================================================================


class _LinearGelu(nn.Module):
    def __init__(self, use):
        super().__init__()
        self.use = use
        self.fc1, self.fc2 = nn.Linear(16, 40), nn.Linear(40, 16)

    def forward(self, x):
        h = self.fc1(x)
        if self.use == "detach":
            h.detach()
        elif self.use == "float":
            h.float()
        elif self.use == "chain":
            h.detach().float().abs().amax()
        elif self.use == "write":
            h.detach().mul_(0.5)  # halves h itself before the GELU reads it
        elif self.use == "live":
            return self.fc2(F.gelu(h)), h.detach()
        return self.fc2(F.gelu(h))


@pytest.mark.parametrize("use", ["detach", "float", "chain"])
def test_a_dead_reader_of_the_pre_activation_is_no_other_user(use):
    _check(_LinearGelu(use), [(R(2, 9, 16),)], {"dense": 1})
    _check(_LinearGelu(use), [(R(2, 9, 16),)], {"dense": 1}, backend=_only("dense"))


def test_a_dead_reader_of_the_pre_activation_under_dynamic_shapes():
    _check(_LinearGelu("detach"), [(R(2, s, 16),) for s in (7, 10)], {"dense": 1}, dynamic=True)


def test_a_live_reader_of_the_pre_activation_still_blocks_the_rewrite():
    _check(_LinearGelu("live"), [(R(2, 9, 16),)], {}, near_miss="also feeds detach")


def test_a_dead_write_into_the_pre_activation_still_counts():
    _check(_LinearGelu("write"), [(R(2, 9, 16),)], {}, near_miss="also feeds")


# ========================================================================================================
# Norm and cross-entropy, each run alone (run_passes runs attention's erase first otherwise)
# ========================================================================================================


class _HandWrittenLayerNorm(nn.Module):
    def __init__(self, use):
        super().__init__()
        self.use = use
        self.w, self.b = nn.Parameter(1 + 0.1 * R(24)), nn.Parameter(0.1 * R(24))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        xc = x - mu
        var = xc.pow(2).mean(-1, keepdim=True)
        if self.use == "dead":
            var.detach()
        y = xc * torch.rsqrt(var + 1e-5) * self.w + self.b
        return (y, var.detach()) if self.use == "live" else y


def test_a_dead_reader_of_a_norm_intermediate_is_no_other_user():
    _check(_HandWrittenLayerNorm("dead"), [(R(2, 9, 24),)], {"norm": 1}, backend=_only("norm"))


def test_a_live_reader_of_a_norm_intermediate_still_blocks_the_rewrite():
    _check(_HandWrittenLayerNorm("live"), [(R(2, 9, 24),)], {}, near_miss="has users outside the norm",
           backend=_only("norm"))


class _LogSoftmaxNll(nn.Module):
    def __init__(self, use):
        super().__init__()
        self.use = use
        self.head = nn.Linear(16, 11)

    def forward(self, x, y):
        lp = F.log_softmax(self.head(x), dim=-1)
        if self.use == "dead":
            lp.detach().exp()
        loss = F.nll_loss(lp.view(-1, 11), y.view(-1))
        return (loss, lp.detach()) if self.use == "live" else loss


def test_a_dead_reader_of_the_log_probabilities_is_no_other_user():
    args = (R(2, 9, 16), torch.randint(0, 11, (2, 9)))
    _check(_LogSoftmaxNll("dead"), [args], {"cross_entropy": 1}, backend=_only("cross_entropy"))


def test_a_live_reader_of_the_log_probabilities_still_blocks_the_rewrite():
    args = (R(2, 9, 16), torch.randint(0, 11, (2, 9)))
    _check(_LogSoftmaxNll("live"), [args], {}, near_miss="also used by", backend=_only("cross_entropy"))


class _DeadViewOfReturnedLogits(nn.Module):
    """The logits returned beside their fused loss come back padded (README's known gap), so a .view(-1)
    of them fails; one nobody reads (left by dynamo) failed the call too, and is erased now."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 11)

    def forward(self, x, y):
        logits = self.head(x)
        logits.view(-1)
        return logits, F.cross_entropy(logits.view(-1, 11), y.view(-1))


def test_a_dead_view_of_returned_fused_logits_is_erased():
    args = (R(2, 9, 16), torch.randint(0, 11, (2, 9)))
    _check(_DeadViewOfReturnedLogits(), [args], {"cross_entropy": 1})
