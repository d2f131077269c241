"""End to end on the H200: one bf16 training step (forward, backward, AdamW) of transformers models built
from their configs (random init, no download), eager vs Inductor vs backend="flash", in one run.

    python bench/bench_e2e.py [--configs gpt2-eager,gpt2-sdpa,bert-sdpa,vit-sdpa] [--budget-s 420]

Per model and mode: tokens (or images) per second of the steady-state step (median, do_bench), peak
memory of a step, the first step's wall time (dynamo + Inductor compile included; csrc's one-time ninja
build is done and printed before any step) and the loss after 20 steps on one fixed batch (the three modes
start from the same weights; dropout stays on, so equal means "within bf16/dropout noise").

Each (model, mode) runs in a process of its own with empty Inductor and Triton caches (--in-process runs
them all in this process, sharing caches, as before 2026-11-21): a first step is then what a user's first
run pays, and no mode's figures depend on what ran before it. In one process they did: BERT's flash first
step measured 34.9 s there, 29.3 s in a fresh process (bench/logs/first_step_bert_*_h200.log), and a model
compiled after another reused the kernels that one had put in the shared caches.

The first step is the median of --first-step-repeats fresh processes per compiled mode: the first one, which
also measures the steady state, and the rest timing the first step alone, Inductor and flash alternating
which goes first. One compile of the same BERT step measured 28.4-40.1 s (Inductor) and 28.8-34.3 s (flash)
on one machine (bench/logs/first_step_bert_repeats_h200.log); a single sample per mode put the ratio anywhere
from 1.16x to 1.68x. Before the first config, a throwaway child compiles a small CUDA function, so that no
mode pays for the machine's cold file caches (the first compiling process on a freshly started machine was
the 40.1 s one).

Compiles dominate the runtime: configs are run in order until --budget-s is spent, and the table says which
were skipped. Writes bench/results/e2e.json (rows written as they come) and prints a markdown table last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS_DIR, Results, bench_ms, env_info, markdown_table  # noqa: E402

DTYPE = torch.bfloat16
LOSS_STEPS = 20
CONFIGS = {
    # name: (model, attn_implementation, batch, seq or image size)
    "gpt2-eager": ("gpt2", "eager", 16, 1024),
    "gpt2-sdpa": ("gpt2", "sdpa", 16, 1024),
    "bert-sdpa": ("bert", "sdpa", 32, 512),
    "vit-sdpa": ("vit", "sdpa", 64, 224),
    "bert-eager": ("bert", "eager", 32, 512),
    "vit-eager": ("vit", "eager", 64, 224),
}
MODES = ("eager", "inductor", "flash")
# "flash" runs flash_backend/config.py's switches as they are (defaults or environment). Extra modes set one:
# flash_route_sdpa routes F.scaled_dot_product_attention calls to our attention op too (only differs from
# "flash" on the *-sdpa configs); flash_dense / flash_no_dense fuse Linear + GELU in training graphs or not.
_EXTRA_MODE_SWITCHES = {"flash_route_sdpa": ("route_sdpa_calls_on_cuda", True),
                        "flash_dense": ("dense_training_on_cuda", True),
                        "flash_no_dense": ("dense_training_on_cuda", False)}
EXTRA_MODES = tuple(_EXTRA_MODE_SWITCHES)


@contextlib.contextmanager
def _switch_for(mode: str):
    """config.py's switch of an extra mode set for that mode's run, and restored after it."""
    from flash_backend import config as flash_config

    name, value = _EXTRA_MODE_SWITCHES.get(mode, (None, None))
    saved = getattr(flash_config, name) if name else None
    if name:
        setattr(flash_config, name, value)
    try:
        yield
    finally:
        if name:
            setattr(flash_config, name, saved)


def _build(model: str, attn: str, batch: int, size: int):
    """(model, inputs, loss_fn, items per step) on CUDA in bf16, from a fixed seed."""
    import transformers

    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    if model == "gpt2":
        cfg = transformers.GPT2Config(n_positions=size, attn_implementation=attn)
        net = transformers.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, cfg.vocab_size, (batch, size), device="cuda", generator=gen)
        inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
        items = batch * size
    elif model == "bert":
        cfg = transformers.BertConfig(attn_implementation=attn)
        net = transformers.BertForMaskedLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (batch, size), device="cuda", generator=gen)
        lengths = torch.randint(size // 2, size + 1, (batch,), device="cuda", generator=gen)
        lengths[0] = size
        mask = (torch.arange(size, device="cuda")[None, :] < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        items = batch * size
    else:
        cfg = transformers.ViTConfig(image_size=size, attn_implementation=attn, num_labels=1000)
        net = transformers.ViTForImageClassification(cfg)
        pixels = torch.randn(batch, 3, size, size, device="cuda", generator=gen, dtype=DTYPE)
        labels = torch.randint(0, 1000, (batch,), device="cuda", generator=gen)
        inputs = {"pixel_values": pixels, "labels": labels}
        items = batch
    net = net.to(device="cuda", dtype=DTYPE).train()
    return net, inputs, items


def _run_mode(config: str, mode: str, results: Results, table: list, first_step_only: bool = False):
    """Measure one (config, mode); with first_step_only, only the first step's wall time (returned)."""
    from flash_backend.backend import flash_backend as flash_backend_fn
    from fx_passes._compat import counters

    model_name, attn, batch, size = CONFIGS[config]
    torch._dynamo.reset()  # drops the previous mode's compiled model: peak memory is this mode's alone
    gc.collect()
    torch.cuda.empty_cache()
    net, inputs, items = _build(model_name, attn, batch, size)
    counters.clear()
    forward = (
        net
        if mode == "eager"
        else torch.compile(net, backend="inductor" if mode == "inductor" else flash_backend_fn)
    )
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=True)

    def step():
        loss = forward(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_step_s = time.perf_counter() - t0
    if first_step_only:
        return first_step_s
    for _ in range(LOSS_STEPS - 2):
        step()
    loss20 = step().item()
    torch.cuda.reset_peak_memory_stats()
    ms = bench_ms(step, warmup_ms=100, rep_ms=500)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    rewrites = dict(counters["flash"])
    unit = "images/s" if model_name == "vit" else "tokens/s"
    throughput = items / (ms / 1e3)
    case = {
        "model": model_name,
        "attn": attn,
        "batch": batch,
        ("image" if model_name == "vit" else "seq"): size,
        "dtype": "bf16",
        "step": "fwd+bwd+AdamW",
    }
    results.add(
        mode,
        "train",
        case,
        ms,
        throughput=round(throughput, 1),
        unit=unit,
        peak_mem_gib=round(peak_gib, 3),
        first_step_s=round(first_step_s, 2),
        loss_step20=round(loss20, 4),
        flash_rewrites=rewrites,
        commit=env_info()["commit"],
    )
    table.append(
        [
            config,
            mode,
            throughput,
            ms,
            peak_gib,
            first_step_s,
            loss20,
            rewrites.get("attention", 0) if mode.startswith("flash") else "",
        ]
    )
    print(
        f"{config:11s} {mode:9s} {throughput:10.1f} {unit}  {ms:8.2f} ms  peak {peak_gib:6.2f} GiB  "
        f"first step {first_step_s:6.1f} s  loss@{LOSS_STEPS} {loss20:.4f}  flash {rewrites}",
        flush=True,
    )
    return first_step_s


@contextlib.contextmanager
def _empty_compile_caches():
    """(scratch folder, environment) for a child process whose Inductor and Triton caches start empty; the
    folder is removed afterwards."""
    scratch = Path(tempfile.mkdtemp(prefix="flash_e2e_"))
    try:
        yield scratch, dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"),
                            TRITON_CACHE_DIR=str(scratch / "triton"), PYTHONUNBUFFERED="1")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_isolated(config: str, mode: str, results: Results, table: list, timeout_s: float,
                  first_step_only: bool = False) -> float:
    """_run_mode in a child process with empty Inductor and Triton caches; its rows join ours. Returns the
    child's first-step wall time."""
    with _empty_compile_caches() as (scratch, env):
        out = scratch / "rows.json"
        command = [sys.executable, __file__, "--child", config, mode, str(out)]
        command += ["--first-step-only"] if first_step_only else []
        proc = subprocess.run(command, env=env, timeout=timeout_s, capture_output=True, text=True)
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0 or not out.exists():
            sys.stderr.write(proc.stderr[-4000:])
            last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            raise RuntimeError(f"child process failed (exit {proc.returncode}): {last}")
        got = json.loads(out.read_text())
    results.rows.extend(got["rows"])
    table.extend(got["table"])
    return got["first_step_s"]


def _config_of(case: dict) -> str:
    return next(name for name, (model, attn, *_) in CONFIGS.items()
                if (model, attn) == (case["model"], case["attn"]))


def _keep_rows_of_other_configs(results: Results, configs: list[str]) -> None:
    """--merge: the committed rows of configs not run now, each stamped with the commit that measured it."""
    path = RESULTS_DIR / "e2e.json"
    if not path.exists():
        return
    old = json.loads(path.read_text())
    for row in old["rows"]:
        if _config_of(row["case"]) not in configs:
            row.setdefault("commit", old["env"]["commit"])
            results.rows.append(row)


def _child(config: str, mode: str, out: str, first_step_only: bool) -> None:
    """One (config, mode) run for _run_isolated: its rows (none when first_step_only) go to `out` as JSON."""
    import flash_backend  # noqa: F401
    from flash_backend.ops import dense

    dense.cublaslt_ready(torch.empty(0, device="cuda", dtype=DTYPE))  # built by the parent: a load here
    torch.backends.cuda.matmul.allow_tf32 = True
    results = Results("e2e")
    table: list = []
    with _switch_for(mode):
        first_step_s = _run_mode(config, mode, results, table, first_step_only)
    Path(out).write_text(json.dumps({"rows": results.rows, "table": table, "first_step_s": first_step_s}))


def _warm_machine(timeout_s: float) -> None:
    """A throwaway child that compiles a small CUDA function with Inductor, in fresh caches: the machine's
    file caches (torch, Triton, ptxas, the CUDA libraries) are then warm for every timed child alike."""
    code = ("import torch\n"
            "f = torch.compile(lambda x: torch.nn.functional.gelu(x @ x).sum())\n"
            "f(torch.randn(256, 256, device='cuda', requires_grad=True)).backward()\n"
            "torch.cuda.synchronize()\n")
    t0 = time.perf_counter()
    with _empty_compile_caches() as (_, env):
        try:
            proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=timeout_s,
                                  capture_output=True, text=True)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[-200:]}"
        except subprocess.TimeoutExpired:
            status = "timed out"
    print(f"machine warm-up compile (not timed in any row): {time.perf_counter() - t0:.1f} s, {status}",
          flush=True)


def _repeat_first_steps(config: str, modes: list[str], first_steps: dict, repeats: int, results: Results,
                        table: list, timeout_s: float) -> None:
    """repeats - 1 more first steps of each compiled mode in fresh children, alternating which mode goes
    first; each row's first_step_s becomes the median of its runs (first_step_runs_s lists them)."""
    compiled = [mode for mode in modes if mode != "eager" and mode in first_steps]
    for round_ in range(1, repeats):
        for mode in compiled if round_ % 2 == 0 else compiled[::-1]:
            first_steps[mode].append(
                _run_isolated(config, mode, results, table, timeout_s, first_step_only=True))
    model, attn = CONFIGS[config][:2]
    for row in results.rows:
        runs = first_steps.get(row["impl"]) if row["impl"] in compiled else None
        if runs and (row["case"]["model"], row["case"]["attn"]) == (model, attn):
            row["first_step_s"] = round(statistics.median(runs), 2)
            row["first_step_runs_s"] = [round(t, 2) for t in runs]
    for entry in table:
        if entry[0] == config and entry[1] in compiled:
            entry[5] = statistics.median(first_steps[entry[1]])
    for mode in compiled:
        print(f"{config:11s} {mode:9s} first steps {', '.join(f'{t:.1f}' for t in first_steps[mode])} s: "
              f"median {statistics.median(first_steps[mode]):.1f} s", flush=True)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default="gpt2-eager,gpt2-sdpa,bert-sdpa,vit-sdpa")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new config after this")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {MODES + EXTRA_MODES}")
    parser.add_argument("--in-process", action="store_true",
                        help="run every (config, mode) in this process, sharing compile caches")
    parser.add_argument("--child-timeout-s", type=float, default=300.0, help="limit of one child process")
    parser.add_argument("--first-step-repeats", type=int, default=3,
                        help="fresh processes per compiled mode whose first steps give the median "
                             "(isolated runs only)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of bench/results/e2e.json whose config is not run now (each row "
                             "names the commit it was measured at)")
    parser.add_argument("--child", nargs=3, metavar=("CONFIG", "MODE", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--first-step-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child, args.first_step_only)
        return
    import flash_backend  # noqa: F401  (registers the ops; the backend is found through the entry point)
    from flash_backend.ops import dense

    # csrc/ (the cuBLASLt GEMMs of the dense and cross-entropy ops) is built by ninja at its first use on a
    # machine and cached on disk: built inside the first step it would land in whichever flash config first
    # uses it (BERT's first step measured 41-42 s on fresh H200 machines this session, against 24-31 s
    # before, unverified whether that is the build). Built here, once, and reported apart.
    t0 = time.perf_counter()
    built = dense.cublaslt_ready(torch.empty(0, device="cuda", dtype=DTYPE))
    print(f"csrc {'built or loaded' if built else 'build failed: the ops use their fallbacks'} in "
          f"{time.perf_counter() - t0:.1f} s, before any timed step", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    results = Results("e2e")
    table: list = []
    skipped = []
    failed: list[str] = []
    if args.merge:
        _keep_rows_of_other_configs(results, args.configs.split(","))
    if not args.in_process:
        _warm_machine(args.child_timeout_s)
    start = time.perf_counter()
    for config in args.configs.split(","):
        if time.perf_counter() - start > args.budget_s:
            skipped.append(config)
            continue
        first_steps: dict[str, list[float]] = {}
        for mode in args.modes.split(","):
            if mode == "flash_route_sdpa" and not config.endswith("-sdpa"):
                continue  # no SDPA call to route: the same graph as "flash"
            try:
                if args.in_process:
                    with _switch_for(mode):
                        first_steps[mode] = [_run_mode(config, mode, results, table)]
                else:
                    first_steps[mode] = [_run_isolated(config, mode, results, table, args.child_timeout_s)]
            except Exception as e:  # noqa: BLE001 - one failing mode must not cost the others' numbers
                msg = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                print(f"{config:11s} {mode:9s} FAILED {msg[:300]}", flush=True)
                failed.append(f"{config}/{mode}: {msg[:300]}")
            results.write()
        if not args.in_process and args.first_step_repeats > 1:
            try:
                _repeat_first_steps(config, args.modes.split(","), first_steps, args.first_step_repeats,
                                    results, table, args.child_timeout_s)
            except Exception as e:  # noqa: BLE001 - the rows keep their single first step
                print(f"{config:11s} first-step repeats FAILED {type(e).__name__}: {str(e)[:300]}",
                      flush=True)
                failed.append(f"{config}/first-step repeats: {str(e)[:300]}")
            results.write()
    results.write()

    by_key = {(r[0], r[1]): r for r in table}
    rows = []
    for r in table:
        ind = by_key.get((r[0], "inductor"))
        speedup = r[2] / ind[2] if ind else float("nan")
        first_ratio = r[5] / ind[5] if ind else float("nan")
        mem_ratio = r[4] / ind[4] if ind else float("nan")
        rows.append(
            [
                r[0],
                r[1],
                round(r[2]),
                round(r[3], 2),
                round(r[4], 2),
                round(r[5], 1),
                round(r[6], 4),
                f"{speedup:.2f}x",
                f"{mem_ratio:.2f}x",
                f"{first_ratio:.2f}x",
                r[7],
            ]
        )
    for line in failed:
        print(f"failed: {line}")
    if skipped:
        print(f"\nskipped (budget of {args.budget_s:.0f} s spent): {', '.join(skipped)}")
    print()
    print(
        markdown_table(
            [
                "config",
                "mode",
                "items/s",
                "step ms",
                "peak GiB",
                "first step s",
                f"loss@{LOSS_STEPS}",
                "vs Inductor",
                "mem vs Ind.",
                "1st step vs Ind.",
                "attn rewrites",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
