"""Running the staged benchmark: the arms started, the trials interleaved with progress shown, the
results written (``report``)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sbxnet.app.bench import report, workloads
from sbxnet.app.bench.arms import Lab
from sbxnet.app.bench.plan import ARMS, MODES, Workload, schedule, supports
from sbxnet.app.bench.plan import workloads as plan_workloads
from sbxnet.errors import ConfigError


def _arms(text: str | None) -> list[str]:
    keys = [a.strip() for a in text.split(",") if a.strip()] if text else list(ARMS)
    for k in keys:
        if k not in ARMS:
            raise ConfigError(f"unknown arm {k!r}; arms: {', '.join(ARMS)}")
    return keys


def trial(lab: Lab, mode: Any, arm: str, wl: Workload) -> dict[str, Any]:
    if ARMS[arm].family == "stream":
        return workloads.stream_bulk(lab, lab.stream[arm], wl, mode.bulk_bytes)
    if wl.kind == "bulk":
        return workloads.http_bulk(lab, lab.http[arm], wl)
    return workloads.small(lab, lab.http[arm], wl, mode.small_seconds, mode.newconn_requests)


def arm_info(lab: Lab, key: str, trials: list[dict[str, Any]]) -> dict[str, Any]:
    info: dict[str, Any] = {"stage": ARMS[key].stage, "label": ARMS[key].label, "family": ARMS[key].family}
    if key in lab.skipped:
        info["skipped"] = lab.skipped[key]
        return info
    info["note"] = (lab.http.get(key) or lab.stream[key]).note
    ciphers = {t["result"].get("cipher") for t in trials if t["arm"] == key and "result" in t} - {None}
    info["cipher"] = lab.ciphers.get(key) or ",".join(sorted(ciphers))
    return info


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    mode = MODES[args.mode]
    if args.repeats:
        mode = dataclasses.replace(mode, repeats=args.repeats)
    if args.mib:
        mode = dataclasses.replace(mode, bulk_bytes=args.mib << 20)
    keys = _arms(args.arms)
    loads = plan_workloads(mode.conns, mode.small_conns)
    if args.workloads:
        wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
        unknown = set(wanted) - {w.key for w in loads}
        if unknown:
            raise ConfigError(f"unknown workload(s) {', '.join(sorted(unknown))}; workloads: "
                              + ", ".join(w.key for w in loads))
        loads = [w for w in loads if w.key in wanted]
    console = Console(stderr=True)
    if args.list:
        for a in ARMS.values():
            console.print(f"{a.key:15} stage {a.stage:3} {a.label}")
        for w in loads:
            console.print(f"{w.key:15} {w.label}")
        return 0
    functional_only = os.environ.get("SBXNET_IN_VM") == "1"
    work = Path(tempfile.mkdtemp(prefix="sbxnet-bench-"))
    lab = Lab(work, mode.bulk_bytes, mode.bulk_bytes // mode.conns, mode.small_body)
    machine = lab.gvn.describe_machine()
    machine["haproxy"] = lab.gvn._first_line([lab.fh.HAPROXY, "-v"])
    machine["loadavg_before"] = list(os.getloadavg())
    started = time.time()
    trials: list[dict[str, Any]] = []
    try:
        with console.status("starting the arms (processes, certificates, a check through each)"):
            lab.start(keys)
        for k, why in lab.skipped.items():
            console.print(f"[yellow]not run[/] {k}: {why}", soft_wrap=True)
        running = [k for k in keys if k not in lab.skipped]
        plan = schedule(running, loads, mode.repeats)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("left"), TimeRemainingColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("trials", total=len(plan))
            loop_start = time.time()
            for rep, wl, arm in plan:
                if args.budget and time.time() - started > args.budget:
                    trials.append({"rep": rep, "workload": wl.key, "kind": wl.kind, "arm": arm,
                                   "skipped": f"--budget {args.budget:g} s spent"})
                    progress.advance(task)
                    continue
                progress.update(task, description=f"{arm:14} {wl.key:7} rep {rep + 1}/{mode.repeats}")
                t: dict[str, Any] = {"rep": rep, "workload": wl.key, "kind": wl.kind, "arm": arm,
                                     "loadavg": os.getloadavg()[0]}
                try:
                    t["result"] = trial(lab, mode, arm, wl)
                except (RuntimeError, ValueError, OSError, queue.Empty, subprocess.SubprocessError) as e:
                    t["error"] = str(e)[-1500:]
                    progress.console.print(f"[red]error[/] {arm} {wl.key}: {t['error'][:300]}")
                trials.append(t)
                progress.advance(task)
                if not console.is_terminal:  # a log (the big-machine script's tee) gets a line per trial
                    done = len(trials)
                    spent = time.time() - loop_start
                    console.print(f"{done}/{len(plan)} {arm} {wl.key} rep {rep + 1}/{mode.repeats}: "
                                  f"{'error' if 'error' in t else 'ok'}; {spent:.0f} s, about "
                                  f"{spent / done * (len(plan) - done):.0f} s left", soft_wrap=True)
    finally:
        lab.stop()
        if args.keep:
            console.print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    machine["loadavg_after"] = list(os.getloadavg())
    summary = report.summarize(trials)
    result = {
        "command": " ".join(["sbxnet", "bench", *sys.argv[2:]]) if len(sys.argv) > 1 else "sbxnet bench",
        "mode": mode.name, "settings": dataclasses.asdict(mode), "repeats": mode.repeats,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "seconds": time.time() - started,
        "functional_only": functional_only, "machine": machine,
        "ktls": "available" if lab.ktls_ok else f"not available ({lab.ktls_why})",
        "pump_threads_setting": lab.pump_threads,
        "arms_order": keys,
        "arms": {k: arm_info(lab, k, trials) for k in keys},
        "workloads": {w.key: w.label for w in loads},
        "not_run": [{"arm": k, "workload": w.key, "skipped": supports(ARMS[k], w)} for k in keys
                    if k not in lab.skipped for w in loads if supports(ARMS[k], w)],
        "trials": trials, "summary": summary, "goals": report.goals(summary, mode.conns),
    }
    paths = report.write(result, args.out)
    print(paths["md"].read_text(), flush=True)
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if any("error" in t for t in trials) else 0
