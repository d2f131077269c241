"""What the passes did: every rewrite and every near miss, counted, logged and collected for explain().

Counting follows Inductor's convention: a rewritten subgraph adds one to
``counters["flash"][family]``, a near miss to ``counters["flash"][family + "_skipped"]``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx

from fx_passes._compat import counters

log = logging.getLogger("flash_backend")


def _frames(trace: str) -> list[tuple[str, str, str, str]]:
    """(path, line, function, code) for each frame of a dynamo stack_trace string."""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    frames = []
    for i, line in enumerate(lines):
        if line.startswith("File ") and line.count('"') >= 2:
            path = line.split('"')[1]
            rest = line.split('"')[-1]
            lineno = rest.split("line ")[-1].split(",")[0] if "line " in rest else "?"
            func = rest.rsplit("in ", 1)[-1] if "in " in rest else "?"
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            frames.append((path, lineno, func, code))
    return frames


def source_location(node: torch.fx.Node | None) -> str:
    """'file.py:42 in forward: <code>' for the user line that produced node, or its name.

    Frames inside torch itself (nn.RMSNorm's forward calling F.rms_norm, ...) are skipped: the user
    wants the line of their model that holds the subgraph.
    """
    if node is None:
        return "?"
    frames = _frames(node.meta.get("stack_trace") or "")
    torch_dir = os.path.dirname(torch.__file__)
    user_frames = [f for f in frames if not f[0].startswith(torch_dir)] or frames
    if not user_frames:
        return f"node {node.name}"
    path, lineno, func, code = user_frames[-1]
    where = f"{os.path.basename(path)}:{lineno} in {func}"
    return f"{where}: {code}" if code else where


@dataclass(frozen=True)
class Decision:
    family: str
    rewritten: bool
    variant: str  # which pattern matched (rewrites) or which was attempted (near misses)
    detail: str  # the op it became, or the reason it was left alone
    location: str

    def line(self) -> str:
        if self.rewritten:
            return f"[{self.family}] rewrote {self.variant} -> {self.detail}  ({self.location})"
        return f"[{self.family}] left alone {self.variant}: {self.detail}  ({self.location})"


@dataclass(eq=False)  # compared by identity: collecting() removes its own report from nested ones
class Report:
    decisions: list[Decision] = field(default_factory=list)

    @property
    def rewrites(self) -> list[Decision]:
        return [d for d in self.decisions if d.rewritten]

    @property
    def near_misses(self) -> list[Decision]:
        return [d for d in self.decisions if not d.rewritten]

    def counts(self) -> Counter:
        return Counter(d.family for d in self.rewrites)

    def __str__(self) -> str:
        if not self.decisions:
            return "flash_backend: no candidate subgraphs were found."
        counts = ", ".join(f"{fam}: {n}" for fam, n in sorted(self.counts().items())) or "none"
        out = [
            f"flash_backend: {len(self.rewrites)} rewrite(s) ({counts}), "
            f"{len(self.near_misses)} near miss(es)"
        ]
        out += ["  " + d.line() for d in self.decisions]
        return "\n".join(out)


# explain() and tests push a Report here to collect what a compilation decided.
_collectors: list[Report] = []


@contextlib.contextmanager
def collecting():
    report = Report()
    _collectors.append(report)
    try:
        yield report
    finally:
        _collectors.remove(report)


# Decisions of a compilation still in progress (see committed_only). None: emit at once.
_pending: list[list[Decision]] = []


@contextlib.contextmanager
def committed_only():
    """Count, log and collect the decisions made inside only if the block completes.

    A compile can be abandoned after the passes ran: Inductor (or the norm pass itself) restarts dynamo's
    analysis with some values specialised, and the passes then run again on the new graph. Without this,
    each restart counted every rewrite twice (ViT-base: 24 attention rewrites for 12 layers).
    """
    pending: list[Decision] = []
    _pending.append(pending)
    try:
        yield
    except BaseException:
        _pending.remove(pending)
        raise
    _pending.remove(pending)
    for decision in pending:
        _emit(decision)


def _record(decision: Decision) -> None:
    if _pending:
        _pending[-1].append(decision)
    else:
        _emit(decision)


def _emit(decision: Decision) -> None:
    key = decision.family if decision.rewritten else decision.family + "_skipped"
    counters["flash"][key] += 1
    log.info("%s", decision.line())
    for report in _collectors:
        report.decisions.append(decision)


def record_rewrite(family: str, variant: str, op: str, node: torch.fx.Node | None) -> None:
    _record(Decision(family, True, variant, op, source_location(node)))


def record_near_miss(family: str, variant: str, reason: str, node: torch.fx.Node | None) -> None:
    _record(Decision(family, False, variant, reason, source_location(node)))
