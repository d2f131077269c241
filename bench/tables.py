"""Render the committed H200 results (bench/results/*.json) as the markdown tables of the README.

    python bench/tables.py            # every table
    python bench/tables.py layer_norm

Ratios are ours over each anchor measured in the same run (time ratio: anchor ms / our ms).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import markdown_table  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _table(header: list[str], rows: list[list]) -> str:
    return markdown_table(header, rows, float_fmt=".2f")


def _stamp(data: dict) -> str:
    env = data["env"]
    # Rows merged from several runs (bench_e2e.py --merge) each name the commit that measured them.
    commits = sorted({row.get("commit", env["commit"]) for row in data["rows"]} or {env["commit"]})
    commit = f"commit {commits[0]}" if len(commits) == 1 else f"commits {', '.join(commits)} (per row)"
    return f"_{env['gpu']}, torch {env['torch']}, Triton {env['triton']}, {commit}, {env['date']}_"


def _ratio(anchor_ms, our_ms):
    return anchor_ms / our_ms if anchor_ms and our_ms else None


def _grouped(data: dict, key) -> dict:
    groups: dict = defaultdict(dict)
    for row in data["rows"]:
        k = key(row)
        if k is not None:
            groups[k][row["impl"]] = row
    return groups


def attention() -> str:
    data = _load("attention")

    def key(r):
        c = r["case"]
        heads = f"{c['Hq']}/{c['Hkv']}" if c["Hq"] != c["Hkv"] else str(c["Hq"])
        mask = " + padding mask" if c.get("mask") else ""
        return (f"{c['B']},{heads},{c['S']},{c['D']}{mask}", "yes" if c["causal"] else "no", r["mode"])

    rows = []
    for (shape, causal, mode), impls in _grouped(data, key).items():
        ours = impls.get("ours")
        if ours is None:
            continue
        tf = {name: impls[name]["tflops"] if name in impls else None for name in ("cudnn", "fa2", "flex")}
        ratio = {name: ours["tflops"] / v if v else None for name, v in tf.items()}
        rows.append([shape, causal, mode, ours["tflops"], tf["cudnn"], tf["fa2"], tf["flex"],
                     ratio["cudnn"], ratio["fa2"], ratio["flex"]])
    header = ["B,H,S,D", "causal", "mode", "ours TFLOP/s", "cuDNN", "FA2", "flex",
              "x cuDNN", "x FA2", "x flex"]
    return _stamp(data) + "\n\n" + _table(header, rows)


def dense() -> str:
    data = _load("dense")

    def key(r):
        c = r["case"]
        return (c["approximate"], c["M"], c["K"], c["N"], r["mode"])

    rows = []
    others = ("eager", "inductor", "inductor_max_autotune", "addmm_activation")
    for (approx, m, k, n, mode), impls in _grouped(data, key).items():
        ours = impls.get("flash")
        if ours is None:
            continue
        # GPU time (graph replay) where the run recorded it: at K=768 the Python side of every
        # implementation is as long as its kernels and varies by +-30 % between runs (NOTES_dense.md).
        field = "graph_tflops" if ours.get("graph_tflops") else "tflops"
        tf = {name: impls[name].get(field) if name in impls else None for name in others}
        best = max((v for v in tf.values() if v), default=None)
        ind = tf["inductor"]
        rows.append([approx, m, f"{k}x{n}", mode, ours[field], *tf.values(),
                     ours[field] / ind if ind else None, ours[field] / best if best else None])
    timing = ("GPU time (CUDA-graph replay)" if any(r.get("graph_tflops") for r in data["rows"])
              else "calls from Python")
    header = ["GELU", "M", "KxN", "mode", "ours TFLOP/s", "eager", "Inductor", "max-autotune",
              "addmm_act", "x Inductor", "x best other"]
    return _stamp(data) + f"\n\nTFLOP/s from {timing}, bf16\n\n" + _table(header, rows)


def layer_norm() -> str:
    data = _load("layer_norm")
    copies = [r["tbps"] for r in data["rows"] if r["impl"] == "copy"]
    copy = max(copies) if copies else None

    def key(r):
        c = r["case"]
        return (c["N"], c["norm"], r["mode"]) if "N" in c else None

    rows = []
    for (n, norm, mode), impls in sorted(_grouped(data, key).items()):
        ours, ind, eager = impls.get("flash_compiled"), impls.get("inductor"), impls.get("eager")
        if ours is None or ind is None:
            continue
        rows.append([n, norm, mode, ours["ms"], ind["ms"], eager["ms"] if eager else None,
                     ind["ms"] / ours["ms"],
                     ours.get("graph_tbps"), ind.get("graph_tbps"),
                     _ratio(ind.get("graph_ms"), ours.get("graph_ms")),
                     ours["graph_tbps"] / copy if copy and ours.get("graph_tbps") else None])
    header = ["N", "norm", "mode", "flash ms", "Inductor ms", "eager ms", "x Inductor",
              "flash TB/s (graph)", "Inductor TB/s (graph)", "x Inductor (graph)", "flash of copy (graph)"]
    note = (f"M=16384, bf16, dropout 0.1 + residual; `flash` = the unfused module under "
            f"`torch.compile(backend=\"flash\")`; copy ceiling measured in the run: {copy} TB/s; "
            "(graph) = the step replayed from a CUDA graph, GPU time alone (the implementations of a case "
            "in interleaved rounds, L2 cleared before each replay)")
    return _stamp(data) + "\n\n" + note + "\n\n" + _table(header, rows)


def e2e() -> str:
    data = _load("e2e")

    def key(r):
        c = r["case"]
        return (c["model"], c.get("attn"), c["batch"], c.get("seq"))

    rows = []
    for (model, attn, batch, seq), impls in _grouped(data, key).items():
        ind = impls.get("inductor")
        for name in ("eager", "inductor", "flash", "flash_no_dense", "flash_route_sdpa"):
            r = impls.get(name)
            if r is None or "throughput" not in r:
                continue
            runs = r.get("first_step_runs_s") if name != "eager" else None
            first = f"{r['first_step_s']:.1f}" + (f" ({', '.join(f'{t:.1f}' for t in runs)})" if runs else "")
            rows.append([f"{model} ({attn} attn) B{batch}" + (f" S{seq}" if seq else ""), name,
                         round(r["throughput"]), r["unit"],
                         r["throughput"] / ind["throughput"] if ind else None,
                         r["peak_mem_gib"], r["peak_mem_gib"] / ind["peak_mem_gib"] if ind else None,
                         first, r["first_step_s"] / ind["first_step_s"] if ind else None,
                         r.get("loss_step20"),
                         ", ".join(f"{k} {v}" for k, v in r.get("flash_rewrites", {}).items()) or ""])
    header = ["model", "backend", "throughput", "unit", "x Inductor", "peak GiB", "mem x Inductor",
              "first step s", "first step x Inductor", "loss@20", "rewrites"]
    note = ("first step: the compiling step's wall time in a fresh process with empty caches; where runs are "
            "listed in parentheses, the median of those fresh processes (bench_e2e.py --first-step-repeats), "
            "else one run")
    return _stamp(data) + "\n\n" + note + "\n\n" + _table(header, rows)


def attention_dropout() -> str:
    data = _load("attention_dropout")

    def key(r):
        c = r["case"]
        return (c["B"], c["Hq"], c["S"], c["D"], c["causal"], r["mode"])

    rows = []
    for (b, h, s, d, causal, mode), impls in _grouped(data, key).items():
        ours = impls.get("ours")
        best = max((impls[n]["tflops"] for n in ("cudnn", "fa2", "efficient") if n in impls), default=None)
        rows.append([f"{b},{h},{s},{d}", "yes" if causal else "no", mode, ours["tflops"] if ours else None,
                     impls["ours_p0"]["tflops"] if "ours_p0" in impls else None,
                     *(impls[n]["tflops"] if n in impls else None for n in ("cudnn", "fa2", "efficient")),
                     ours["tflops"] / best if ours and best else None])
    header = ["B,H,S,D", "causal", "mode", "ours p=0.1 TF/s", "ours p=0", "cuDNN p=0.1", "FA2 p=0.1",
              "efficient p=0.1", "x best SDPA"]
    return _stamp(data) + "\n\n" + _table(header, rows)


def cross_entropy() -> str:
    data = _load("cross_entropy")

    def key(r):
        c = r["case"]
        return (c["head"], c["M"], c["K"], c["V"], c["bias"], c["upcast"], r["mode"])

    rows = []
    for (head, m, k, v, bias, upcast, mode), impls in _grouped(data, key).items():
        ours, ind, eager = impls.get("flash"), impls.get("inductor"), impls.get("eager")
        if ours is None:
            continue
        rows.append([head, f"{m}x{k}x{v}", "yes" if bias else "no", "fp32" if upcast else "bf16", mode,
                     ours["ms"], ind["ms"] if ind else None, eager["ms"] if eager else None,
                     _ratio(ind["ms"] if ind else None, ours["ms"]),
                     _ratio(eager["ms"] if eager else None, ours["ms"])])
    header = ["head", "MxKxV", "bias", "loss on", "mode", "flash ms", "Inductor ms", "eager ms", "x Inductor",
              "x eager"]
    note = "bf16; each impl returns (loss, logits) as the models do; fwd+bwd differentiates the loss only"
    return _stamp(data) + "\n\n" + note + "\n\n" + _table(header, rows)


TABLES = {"layer_norm": layer_norm, "attention": attention, "attention_dropout": attention_dropout,
          "dense": dense, "cross_entropy": cross_entropy, "e2e": e2e}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(TABLES):
        print(f"### {name}\n\n{TABLES[name]()}\n")
