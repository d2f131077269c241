"""The main job: compile a built-in small GPT with backend="flash", report, check, time.

    python -m flash_backend                 # GPU if there is one, else CPU
    python -m flash_backend --device cpu --layers 2

1. compiles the GPT (training mode, dropout on) and prints what was rewritten into which flash op,
   and the near misses left alone with their reasons;
2. checks the compiled model against eager: logits in eval mode, loss and every gradient in training
   mode with dropout off (dropout masks cannot match bit for bit across implementations);
3. times one training step (forward + backward) for eager, Inductor and flash.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flash_backend.demo_gpt import GPT, GPTConfig
from flash_backend.explain import collecting


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _set_dropout(model: torch.nn.Module, p: float) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p


def _train_step(model, idx, targets):
    loss = model(idx, targets)
    loss.backward()
    return loss


def _time_ms(fn, device: torch.device, iters: int) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=max(100, iters * 10), return_mode="median"))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flash_backend", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--iters", type=int, default=5, help="timed steps per backend (CPU)")
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    # Large enough to mean something on an H200, small enough to finish in seconds on 2 CPU cores.
    cfg = GPTConfig(n_layer=args.layers or (12 if on_gpu else 2), n_embd=768 if on_gpu else 128,
                    n_head=12 if on_gpu else 4, block_size=1024 if on_gpu else 128, vocab_size=8192)
    batch, seq = args.batch or (16 if on_gpu else 4), args.seq or cfg.block_size
    dtype = torch.bfloat16 if on_gpu else torch.float32
    print(f"flash_backend main job: GPT {cfg.n_layer}x{cfg.n_embd} ({cfg.n_head} heads), batch {batch}, "
          f"seq {seq}, {dtype} on {device}")

    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=dtype)
    idx = torch.randint(cfg.vocab_size, (batch, seq), device=device)
    targets = torch.randint(cfg.vocab_size, (batch, seq), device=device)

    # 1. What the flash backend rewrites (training graph, dropout on).
    flash_model = torch.compile(model, backend="flash")
    with collecting() as report:
        _train_step(flash_model, idx, targets)
    print("\n== what was rewritten ==")
    print(report)

    # 2. Check against eager.
    print("\n== check against eager ==")
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    failures = 0
    model.eval()
    with torch.no_grad():
        err = _relative_error(flash_model(idx), model(idx))
    failures += err > tol
    print(f"eval logits          relative error {err:.2e}  (limit {tol:.0e})")
    model.train()
    _set_dropout(model, 0.0)
    model.zero_grad(set_to_none=True)
    loss_eager = _train_step(model, idx, targets)
    grads_eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss_flash = _train_step(flash_model, idx, targets)
    err = _relative_error(loss_flash.detach(), loss_eager.detach())
    failures += err > tol
    print(f"train loss           relative error {err:.2e}  (limit {tol:.0e})")
    grad_errors = {n: _relative_error(p.grad, grads_eager[n]) for n, p in model.named_parameters()}
    worst_name = max(grad_errors, key=grad_errors.get)
    worst = grad_errors[worst_name]
    failures += worst > 10 * tol
    print(f"gradients (worst)    relative error {worst:.2e}  (limit {10 * tol:.0e}) at {worst_name}")
    _set_dropout(model, cfg.dropout)

    # 3. Timings: one training step with dropout on.
    if not args.no_timing:
        print("\n== one training step (forward + backward) ==")
        inductor_model = torch.compile(model, backend="inductor")
        rows = []
        for name, m in (("eager", model), ("inductor", inductor_model), ("flash", flash_model)):
            step = lambda m=m: _train_step(m, idx, targets)  # noqa: E731
            step()  # compile / warm up
            rows.append((name, _time_ms(step, device, args.iters)))
        base = dict(rows)["inductor"]
        print("| backend | ms/step | tokens/s | vs inductor |\n|---|---|---|---|")
        for name, ms in rows:
            print(f"| {name} | {ms:.2f} | {batch * seq / ms * 1e3:,.0f} | {base / ms:.2f}x |")

    print("\nresult:", "OK" if not failures else f"{failures} check(s) FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
