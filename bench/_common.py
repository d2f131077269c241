"""Helpers shared by the bench scripts: timing, environment stamp, JSON rows and a markdown table.

Every script writes bench/results/<name>.json in the format of shared/DESIGN.md:
{"env": {"torch", "triton", "gpu", "commit", "date"},
 "rows": [{"impl", "mode", "case", "ms", "tflops"|"tbps"}]}
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def max_rel_diff(got, ref) -> float:
    """max |got - ref| / max |ref| over paired lists of tensors (empty ones skipped): how far a candidate
    launch shape's results are from the reference shape's (different tiles round differently)."""
    err = 0.0
    for g, r in zip(got, ref, strict=True):
        if r.numel():
            scale = r.float().abs().max().clamp_min(1e-30)
            err = max(err, ((g.float() - r.float()).abs().max() / scale).item())
    return err


def bench_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds of fn() with CUDA events (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def capture_graph(step) -> torch.cuda.CUDAGraph:
    """step captured in a CUDA graph, after two warm-up calls on a side stream (as capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def capture_graph_or_none(step) -> torch.cuda.CUDAGraph | None:
    """capture_graph, or None after printing why the step could not be captured (the benchmark goes on)."""
    try:
        return capture_graph(step)
    except Exception as e:  # report, keep benchmarking the rest
        print(f"  graph capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def graph_ms(step) -> float | None:
    """GPU time alone: the step captured in a CUDA graph and replayed (no Python launch overhead)."""
    graph = capture_graph_or_none(step)
    return bench_ms(graph.replay) if graph is not None else None


def interleaved_graph_us(graphs: dict, rounds: int = 7, reps: int = 30, clear_l2: bool = False) -> dict:
    """Median microseconds per replay of each captured graph, timed in rounds that visit every graph in
    turn, so that a clock or power drift during the run lands on every candidate alike (timed one after
    the other, identical kernels measured up to 20 % apart on the H200).

    clear_l2: time each replay alone after overwriting a 256 MB buffer, as triton's do_bench does, so that a
    memory-bound step does not find its inputs in L2 from the replay before (the flush is not timed)."""
    times = {key: [] for key in graphs}
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if clear_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(rounds):
        for key, graph in graphs.items():
            graph.replay()
            if clear_l2:
                for start, stop in zip(starts, stops, strict=True):
                    flush.zero_()
                    start.record()
                    graph.replay()
                    stop.record()
                stops[-1].synchronize()
                times[key] += [a.elapsed_time(b) * 1e3 for a, b in zip(starts, stops, strict=True)]
            else:
                starts[0].record()
                for _ in range(reps):
                    graph.replay()
                stops[0].record()
                stops[0].synchronize()
                times[key].append(starts[0].elapsed_time(stops[0]) * 1e3 / reps)
    return {key: sorted(t)[len(t) // 2] for key, t in times.items()}


def _commit() -> str:
    # The GPU machine gets a copy of the tree without .git: the caller passes FLASH_COMMIT there.
    if os.environ.get("FLASH_COMMIT"):
        return os.environ["FLASH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def env_info() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "gpu": gpu,
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


class Results:
    """Collects typed rows, prints a markdown table and writes the JSON file."""

    def __init__(self, name: str):
        self.name = name
        self.rows: list[dict] = []

    def add(self, impl: str, mode: str, case: dict, ms: float, *, tflops: float | None = None,
            tbps: float | None = None, **extra) -> dict:
        row = {"impl": impl, "mode": mode, "case": dict(case), "ms": round(ms, 5)}
        if tflops is not None:
            row["tflops"] = round(tflops, 2)
        if tbps is not None:
            row["tbps"] = round(tbps, 3)
        row.update(extra)
        self.rows.append(row)
        return row

    def write(self, path: Path | None = None) -> Path:
        path = path or RESULTS_DIR / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"env": env_info(), "rows": self.rows}, indent=1) + "\n")
        return path


def markdown_table(header: list[str], rows: list[list], float_fmt: str = ".3g") -> str:
    def fmt(v):
        if v is None:
            return "–"
        return format(v, float_fmt) if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
