"""fx_passes._match.in_place_writers follows the result of a write (review s29).

An in-place call returns the tensor it wrote: ``m = torch.ones(S, S).tril_(); m[0] = 0`` writes the ones
tensor through tril_'s result. in_place_writers stopped at the in-place call, so the second write was not
among the writers of the first tensor, nor, with the in-place call allowed (in a pattern), any write after
it. The attention pass has its own walk for this (_storage_family); the other callers (written_before_end in
every family, the cross-entropy pass's logits check, _functionalize) use this one.
"""

from __future__ import annotations

import torch

from fx_passes._match import in_place_writers


def _graph(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def _node(graph, name):
    def named(n):
        return getattr(n.target, "__name__", None) == name if n.op == "call_function" else n.target == name

    return next(n for n in graph.nodes if named(n))


def test_a_write_through_an_in_place_result_is_a_writer():
    def fn(x):
        m = torch.ones(4, 4).tril_()
        m[0] = 0.0
        return x + m

    graph = _graph(fn, torch.randn(4, 4))
    ones = _node(graph, "ones")
    writers = [w.name for w in in_place_writers(ones)]
    assert len(writers) == 2, writers  # tril_ and the setitem through its result


def test_allowed_writes_are_followed_but_not_reported():
    def fn(x):
        m = torch.ones(4, 4).tril_()
        m.mul_(2.0)
        return x + m

    graph = _graph(fn, torch.randn(4, 4))
    ones, tril = _node(graph, "ones"), _node(graph, "tril_")
    writers = in_place_writers(ones, [tril])
    assert [w.target for w in writers] == ["mul_"], writers

