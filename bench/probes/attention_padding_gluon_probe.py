"""H200: padding masks on the Gluon kernels (kernels/attention_fwd_hopper.py, attention_bwd_hopper.py) against
our Triton kernels and SDPA's backends that take the mask, forward and forward+backward, GPU time.

Each step is captured in a CUDA graph (the routing is decided when it is captured) and replayed in interleaved
rounds. Masks as bench_attention.py builds them: right padding, each sequence between `shortest` * S and S
keys long, a (B, 1, 1, S) row. Run: PYTHONPATH=. python bench/probes/attention_padding_gluon_probe.py"""

# ruff: noqa: B023  (each closure is captured in a graph inside the iteration that defines it)

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench._common import capture_graph_or_none, interleaved_graph_us
from bench.bench_attention import _padding_mask
from flash_backend import config
from flash_backend.ops.attention import flash_attention

SHAPES = [  # B, H, S, D, mask kind, shortest live fraction
    (8, 16, 2048, 64, "additive", 0.75),  # bench_attention's padding row
    (8, 16, 2048, 64, "bool", 0.5),
    (8, 16, 2048, 128, "additive", 0.75),
    (4, 16, 4096, 128, "bool", 0.5),
    (4, 16, 4096, 64, "additive", 0.75),
    (8, 16, 2048, 64, "additive", 1.0),  # every key live: the padding path's cost alone
]
SDPA = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _graph(fn, q, k, v, dout, mode):
    def step():
        if mode == "fwd":
            with torch.no_grad():
                fn(q, k, v)
        else:
            torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    return capture_graph_or_none(step)


def main():
    torch.manual_seed(0)
    print(f"{'B,H,S,D mask':>26} {'mode':>7} | {'gluon us':>9} {'triton us':>9} {'cudnn us':>9} "
          f"{'eff us':>9} {'no mask':>9} | {'x triton':>8} {'x best sdpa':>11}", flush=True)
    for B, H, S, D, kind, shortest in SHAPES:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        mask = _padding_mask(B, S, shortest, kind)
        dout = torch.randn_like(q)
        for mode in ("fwd", "fwd+bwd"):
            graphs = {}
            for name, gluon in (("gluon", True), ("triton", False)):
                config.hopper_attention_forward = config.hopper_attention_backward = gluon
                ours = lambda a, b, c: flash_attention(a, b, c, attn_mask=mask)  # noqa: E731
                graphs[name] = _graph(ours, q, k, v, dout, mode)
            config.hopper_attention_forward = config.hopper_attention_backward = True
            # the same call without its mask: what the padding costs beyond skipping dead key blocks
            graphs["nomask"] = _graph(lambda a, b, c: flash_attention(a, b, c), q, k, v, dout, mode)
            for name, backend in SDPA.items():
                def sdpa(a, b, c, backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(a, b, c, attn_mask=mask)
                try:
                    graphs[name] = _graph(sdpa, q, k, v, dout, mode)
                except RuntimeError as err:  # this backend refuses the mask
                    print(f"  {name}: {str(err).splitlines()[0][:100]}")
            graphs = {key: g for key, g in graphs.items() if g is not None}
            us = interleaved_graph_us(graphs, rounds=7, reps=20)
            best = min(us.get("cudnn", float("inf")), us.get("efficient", float("inf")))
            label = f"{B},{H},{S},{D} {kind} {shortest}"
            print(f"{label:>26} {mode:>7} | {us['gluon']:9.1f} {us['triton']:9.1f} "
                  f"{us.get('cudnn', 0):9.1f} {us.get('efficient', 0):9.1f} {us['nomask']:9.1f} | "
                  f"{us['triton'] / us['gluon']:8.3f} {best / us['gluon']:11.3f}", flush=True)


if __name__ == "__main__":
    main()
