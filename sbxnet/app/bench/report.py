"""The staged benchmark's results: the summary (median and range per arm and workload), the goals of
issue 13 as ratios from the same run, a Markdown report, a PNG chart and the JSON of everything."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

BULK = [("gbps", "GB/s"), ("cpu.chain", "chain CPU-s/GB"), ("cpu.front", "front"), ("cpu.hop", "hop"),
        ("cpu.app", "app"), ("cpu.client", "client"), ("others_cores", "others' cores")]
SMALL = [("rps", "requests/s"), ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"),
         ("chain_cpu_ms_per_request", "chain CPU ms/request"), ("others_cores", "others' cores")]
FUNCTIONAL = "functional only: inside the emulated kernel speeds are emulated; never compare these figures"


def _value(result: dict[str, Any], key: str) -> float | None:
    v = result.get("cpu_s_per_gb", {}).get(key[4:]) if key.startswith("cpu.") else result.get(key)
    return float(v) if isinstance(v, int | float) else None


def stat(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(trials: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """arm -> workload -> figure -> {median, min, max, n}, over the trials that gave a result."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for t in trials:
        if "result" not in t:
            continue
        keys = BULK if t["kind"] == "bulk" else SMALL
        cell = out.setdefault(t["arm"], {}).setdefault(t["workload"], {})
        for key, _ in keys:
            v = _value(t["result"], key)
            if v is not None:
                cell.setdefault(key, []).append(v)
    return {a: {w: {k: stat(v) for k, v in figs.items()} for w, figs in ws.items()} for a, ws in out.items()}


def _med(summary: dict[str, Any], arm: str, wl: str, key: str) -> float | None:
    s = summary.get(arm, {}).get(wl, {}).get(key)
    return s["median"] if s else None


def goals(summary: dict[str, Any], conns: int) -> list[dict[str, Any]]:
    """Issue 13's goals, each a ratio of medians from this run; absent where an arm did not run."""
    out: list[dict[str, Any]] = []

    def ratio(goal: str, a: str, b: str, wl: str, key: str, test: Any, invert: bool = False) -> None:
        x, y = _med(summary, a, wl, key), _med(summary, b, wl, key)
        if x is None or y is None or (y if not invert else x) == 0:
            out.append({"goal": goal, "workload": wl, "met": None, "why": f"{a} or {b} has no {key} for {wl}"})
            return
        r = y / x if invert else x / y
        out.append({"goal": goal, "workload": wl, "ratio": r, "met": bool(test(r))})

    for l7 in ("l7-sbx", "l7-nginx"):
        ratio(f"L4 userspace / {l7} throughput >= 2x", "l4-user", l7, "down-1", "gbps", lambda r: r >= 2)
        ratio(f"L4 userspace / {l7} chain CPU-s/GB <= 0.5x", "l4-user", l7, "down-1", "cpu.chain", lambda r: r <= 0.5)
    for wl in ("up-1", f"up-{conns}"):
        # GB per hop CPU-second: the inverse ratio of CPU-s/GB
        ratio("forwarder hop GB per CPU-s >= HAProxy's (tcp + TLS)", "hop-user", "haproxy-tls", wl, "cpu.hop",
              lambda r: r >= 1, invert=True)
    ratio("L4 kTLS / L4 userspace throughput >= 1.2x", "l4-ktls", "l4-user", "down-1", "gbps", lambda r: r >= 1.2)
    ktls = _med(summary, "hop-ktls", "up-1", "cpu.hop")
    out.append({"goal": "forwarder hop (ktls) < 0.49 CPU-s/GB", "workload": "up-1", "value": ktls,
                "met": None if ktls is None else ktls < 0.49, **({} if ktls is not None else {"why": "not run"})})
    return out


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    for limit, f in ((1000, "{:,.0f}"), (100, "{:.0f}"), (10, "{:.1f}"), (1, "{:.2f}")):
        if abs(v) >= limit:
            return f.format(v)
    return f"{v:.3f}"


def _cell(s: dict[str, Any] | None, with_range: bool = True) -> str:
    if not s:
        return "-"
    if not with_range or s["n"] == 1:
        return fmt(s["median"])
    return f"{fmt(s['median'])} ({fmt(s['min'])}-{fmt(s['max'])})"


def markdown(result: dict[str, Any]) -> str:
    m, summary, labels = result["machine"], result["summary"], result["workloads"]
    lines = [f"# sbxnet bench, {result['mode']} mode, {result['started']}", ""]
    if result["functional_only"]:
        lines += [f"**{FUNCTIONAL}.**", ""]
    lines += [f"Machine: {m['cpu_model']}, {m['nproc']} CPUs, Linux {m['kernel']}, {m['openssl']}, Python "
              f"{m['python']}, uvloop {m['uvloop']}; {m['nginx']}; {m['haproxy']}; {m['h2load']}. Load average "
              f"{m['loadavg_before'][0]:.2f} before, {m['loadavg_after'][0]:.2f} after. kTLS: {result['ktls']}.",
              "", f"Command: `{result['command']}` ({result['seconds']:.0f} s; {result['repeats']} repetition(s), "
              f"arms interleaved; median (range); GB = 10^9 bytes; CPU = utime + stime from /proc per GB).", ""]
    mark = " (functional only)" if result["functional_only"] else ""
    lines += [f"| arm | workload | n | GB/s{mark} | chain CPU-s/GB | front | hop | app | client | others' cores |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in result["arms_order"]:
        for wl, figs in summary.get(arm, {}).items():
            if "gbps" in figs:
                n = figs["gbps"]["n"]
                cells = [_cell(figs.get(k), k in ("gbps", "cpu.chain")) for k, _ in BULK]
                lines.append(f"| {arm} | {wl} | {n} | " + " | ".join(cells) + " |")
    lines += ["", f"| arm | workload | n | requests/s{mark} | p50 ms | p99 ms | chain CPU ms/request | others' cores |",
              "|---|---|---|---|---|---|---|---|"]
    for arm in result["arms_order"]:
        for wl, figs in summary.get(arm, {}).items():
            if "rps" in figs:
                cells = [_cell(figs.get(k), k != "others_cores") for k, _ in SMALL]
                lines.append(f"| {arm} | {wl} | {figs['rps']['n']} | " + " | ".join(cells) + " |")
    lines += ["", "Arms:", ""]
    for arm, info in result["arms"].items():
        state = (f"not run: {info['skipped']}" if info.get("skipped")
                 else f"{info.get('note', '')}; {info.get('cipher', '')}")
        lines.append(f"- `{arm}` (stage {info['stage']}): {info['label']} - {state}")
    lines += ["", "Workloads: " + "; ".join(f"`{k}` {v}" for k, v in labels.items()) + ".", ""]
    skips = sorted({(t["arm"], t["workload"], t["skipped"]) for t in result["not_run"]})
    if skips:
        lines.append("Not run by design:")
        for why in sorted({s[2] for s in skips}):
            lines.append(f"- {', '.join(sorted({f'{a} {w}' for a, w, y in skips if y == why}))}: {why}")
        lines.append("")
    late = [t for t in result["trials"] if "skipped" in t]
    if late:
        lines += [f"{len(late)} trial(s) not started: {late[0]['skipped']}.", ""]
    errors = [t for t in result["trials"] if "error" in t]
    for t in errors:
        lines.append(f"- error: {t['arm']} {t['workload']} rep {t['rep']}: {t['error'][:300]}")
    lines += ["", "Goals (ratios of medians from this run):", ""]
    for g in result["goals"]:
        state = {True: "met", False: "NOT met", None: "not measured"}[g["met"]]
        val = f"{g['ratio']:.2f}x" if "ratio" in g else fmt(g.get("value"))
        lines.append(f"- {g['goal']} ({g['workload']}): {val}: {state}" + (f" ({g['why']})" if g.get("why") else ""))
    return "\n".join(lines) + "\n"


def chart(result: dict[str, Any], path: Path) -> None:
    """GB/s and chain CPU-s/GB per arm for each bulk workload, bars at the median, whiskers at the range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    arms = [a for a in result["arms_order"] if any("gbps" in f for f in summary.get(a, {}).values())]
    loads = [w for w, lbl in result["workloads"].items() if w.startswith(("down", "up"))]
    fig, axes = plt.subplots(1, 2, figsize=(14, 1.2 + 0.62 * max(1, len(arms))), sharey=True)
    height = 0.8 / max(1, len(loads))
    for ax, key, title in ((axes[0], "gbps", "GB/s (higher is better)"),
                           (axes[1], "cpu.chain", "chain CPU-s per GB (front + hop; lower is better)")):
        for j, wl in enumerate(loads):
            ys, meds, lo, hi = [], [], [], []
            for i, arm in enumerate(arms):
                s = summary.get(arm, {}).get(wl, {}).get(key)
                if s:
                    ys.append(i + (j - (len(loads) - 1) / 2) * height)
                    meds.append(s["median"])
                    lo.append(s["median"] - s["min"])
                    hi.append(s["max"] - s["median"])
            ax.barh(ys, meds, height=height, xerr=[lo, hi], capsize=2, label=wl)
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
    stage = {"1": "arm 1", "2": "arm 2", "3": "arm 3", "ref": "ref"}
    axes[0].set_yticks(range(len(arms)), [f"{a}\n({stage[result['arms'][a]['stage']]})" for a in arms])
    axes[0].invert_yaxis()
    axes[0].legend(loc="lower right", fontsize="small")
    m = result["machine"]
    head = (f"sbxnet bench ({result['mode']}): {m['nproc']} CPUs {m['cpu_model']}, Linux {m['kernel']}; "
            f"median of {result['repeats']}, whiskers min-max")
    if result["functional_only"]:
        head += f"\n{FUNCTIONAL.upper()}"
    fig.suptitle(head, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: dict[str, Any], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "md": out / "bench.md", "png": out / "bench.png"}
    paths["json"].write_text(json.dumps(result, indent=1, default=str))
    paths["md"].write_text(markdown(result))
    chart(result, paths["png"])
    return paths
