"""Linear + cross-entropy (a language-model head) on the H200: flash linear_cross_entropy vs eager
(F.linear + F.cross_entropy) and Inductor (torch.compile of that), forward and forward+backward, in one run.

    python bench/bench_cross_entropy.py [--sweep]

Cases are the heads of the e2e models (BERT-base MLM: bias, loss on bf16 logits; GPT-2: no bias, logits
upcast to fp32 first, as transformers' causal-LM loss does) and a Llama-sized head. Every impl returns
(loss, logits), as the models do; fwd+bwd differentiates the loss only (the logits output gets no
gradient, as in a training step). --sweep first times the two Triton passes alone over their block
sizes (GB/s on the bytes they must move). Writes bench/results/cross_entropy.json, prints a table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import Results, bench_ms, markdown_table  # noqa: E402
from flash_backend.ops import cross_entropy as ce  # noqa: E402

DTYPE = torch.bfloat16
# name: (M rows, K hidden, V classes, bias, upcast logits to fp32 before the loss)
CASES = {
    "bert-base MLM": (16384, 768, 30522, True, False),
    "gpt2 LM": (16384, 768, 50257, False, True),
    "llama-7b LM": (8192, 4096, 32000, False, True),
}


def _eager(upcast):
    def fn(x, w, b, target):
        logits = F.linear(x, w, b)
        return F.cross_entropy(logits.float() if upcast else logits, target), logits

    return fn


def _flash(upcast):
    def fn(x, w, b, target):
        return ce.linear_cross_entropy(x, w, b, target, loss_dtype=torch.float32 if upcast else None)

    return fn


def _make(impl, upcast):
    if impl == "flash":
        return _flash(upcast)
    if impl == "eager":
        return _eager(upcast)
    torch._dynamo.reset()
    return torch.compile(_eager(upcast), dynamic=False)


def _inputs(m, k, v, bias):
    torch.manual_seed(0)
    x = torch.randn(m, k, dtype=DTYPE, device="cuda")
    w = torch.randn(v, k, dtype=DTYPE, device="cuda") / k**0.5
    b = torch.randn(v, dtype=DTYPE, device="cuda") if bias else None
    target = torch.randint(0, v, (m,), device="cuda")
    target[::7] = -100
    return x, w, b, target


def _time(fn, x, w, b, target, train):
    leaves = [t for t in (x, w, b) if t is not None]
    for t in leaves:
        t.requires_grad_(train)
    if train:
        def step():
            return torch.autograd.grad(fn(x, w, b, target)[0], leaves)
    else:
        def step():
            return fn(x, w, b, target)
    step()  # compile / build outside the timing
    torch.cuda.synchronize()
    return bench_ms(step)


def sweep(m=16384, v=30522):
    """The Triton passes alone, per block size: GB/s on logits read (+ gradient written)."""
    logits = ce._empty_logits(m, v, torch.empty(0, dtype=DTYPE, device="cuda"))
    logits.normal_()
    target = torch.randint(0, v, (m,), device="cuda")
    loss, lse = ce.cross_entropy_fwd_launch(logits, target, -100, 0.0)
    grad_loss = torch.full((m,), 1.0 / m, device="cuda")
    nbytes = m * v * logits.element_size()
    best = {}
    for name, configs, nbytes_moved in (("fwd", [(1024, 4), (2048, 8)], nbytes),
                                        ("bwd", [(512, 4), (1024, 4), (1024, 8), (2048, 8)], 2 * nbytes)):
        for block, warps in configs:
            attr = "_fwd_config" if name == "fwd" else "_bwd_config"
            original = getattr(ce, attr)
            config = (block, warps) if name == "fwd" else (block, warps, 128)
            setattr(ce, attr, lambda classes, c=config: c)
            try:
                if name == "fwd":
                    ms = bench_ms(lambda: ce.cross_entropy_fwd_launch(logits, target, -100, 0.0))
                else:
                    ms = bench_ms(lambda: ce.cross_entropy_bwd_launch(grad_loss, None, logits, lse, target,
                                                                       -100, 0.0))
            finally:
                setattr(ce, attr, original)
            tbps = nbytes_moved / ms / 1e9
            print(f"sweep {name} M={m} V={v} BLOCK_V={block:5} warps={warps:2}: {ms * 1e3:7.1f} us "
                  f"{tbps:5.2f} TB/s", flush=True)
            best[name] = min(best.get(name, (ms, block, warps)), (ms, block, warps))
    print(f"best: {best}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    if args.sweep:
        sweep()
    results = Results("cross_entropy")
    table = []
    for name, (m, k, v, bias, upcast) in CASES.items():
        case = {"head": name, "M": m, "K": k, "V": v, "bias": bias, "upcast": upcast, "dtype": "bf16"}
        x, w, b, target = _inputs(m, k, v, bias)
        for train in (False, True):
            mode = "fwd+bwd" if train else "fwd"
            flops = (6 if train else 2) * m * k * v
            row = {}
            for impl in ("flash", "eager", "inductor"):
                ms = _time(_make(impl, upcast), x, w, b, target, train)
                results.add(impl, mode, case, ms, tflops=flops / ms / 1e9)
                row[impl] = ms
                print(f"{name:14} {mode:7} {impl:9} {ms:8.3f} ms", flush=True)
            table.append([name, mode, row["flash"], row["eager"], row["inductor"],
                          row["inductor"] / row["flash"], row["eager"] / row["flash"]])
            results.write()
        del x, w, b, target
    path = results.write()
    print(f"\nwrote {path}\n")
    print(markdown_table(["head", "mode", "flash ms", "eager ms", "inductor ms", "x inductor", "x eager"],
                         table))


if __name__ == "__main__":
    main()
