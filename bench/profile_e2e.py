"""Where a training step's GPU time goes: torch.profiler over a few steps of one bench_e2e config, per
mode, the kernels with the most CUDA time and the step's host vs device time.

    python bench/profile_e2e.py --config gpt2-eager --modes inductor,flash [--top 25]

A diagnostic for choosing what to speed up, not a benchmark: bench_e2e.py gives the numbers we report.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_e2e import CONFIGS, _build  # noqa: E402


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _host_profile(step, steps: int, top: int) -> None:
    """cProfile of `steps` steady-state steps: where the host's time per step goes (the profiler's own cost
    inflates every figure alike; read the ranking, not the absolute numbers)."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
        body = out.getvalue()
        print(f"-- host profile by {key} ({steps} steps)\n" + body[body.find("   ncalls"):].rstrip())


def profile_mode(config: str, mode: str, steps: int, top: int, host_profile: bool = False) -> None:
    from flash_backend.backend import flash_backend as flash_backend_fn

    torch._dynamo.reset()
    net, inputs, _ = _build(*CONFIGS[config])
    forward = net if mode == "eager" else torch.compile(
        net, backend="inductor" if mode == "inductor" else flash_backend_fn)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=True)

    def step():
        forward(**inputs).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host_ms = (time.perf_counter() - t0) * 1e3 / steps  # host returns before the GPU is done...
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps  # ...so this is the step as the GPU finishes it

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(evt.name, [0.0, 0])
            entry[0] += evt.device_time / 1e3 / steps  # us -> ms per step
            entry[1] += 1
    gpu_ms = sum(v[0] for v in kernels.values())
    launches = sum(v[1] for v in kernels.values()) // steps
    print(f"\n== {config} / {mode}: host {host_ms:.2f} ms/step, wall {wall_ms:.2f} ms/step, "
          f"kernels {gpu_ms:.2f} ms/step ({len(kernels)} distinct, {launches} launches a step)")
    print(f"{'ms/step':>8} {'%':>5} {'calls':>6}  kernel")
    for name, (ms, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{ms:8.3f} {100 * ms / gpu_ms:5.1f} {calls // steps:6d}  {_short(name)}")
    if host_profile:
        _host_profile(step, steps, top)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="gpt2-eager", choices=sorted(CONFIGS))
    p.add_argument("--modes", default="inductor,flash")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--host-profile", action="store_true", help="also cProfile the host side of the steps")
    args = p.parse_args()
    import flash_backend  # noqa: F401

    torch.backends.cuda.matmul.allow_tf32 = True
    for mode in args.modes.split(","):
        profile_mode(args.config, mode, args.steps, args.top, args.host_profile)


if __name__ == "__main__":
    main()
