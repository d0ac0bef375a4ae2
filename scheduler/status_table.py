"""``sbxnet scheduler status``: the sandboxes' rows (``GET /v1/sandboxes``) as a table. Pure: rows in, text out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

COLUMNS = ("SANDBOX", "STATE", "LAST ACTIVITY", "BYTES IN", "BYTES OUT", "OPEN", "HOLD", "IDLE IN", "NOTE")


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_span(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 10:
        return f"{s:.1f}s"
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 2 * 86400:
        return f"{s / 3600:.0f}h"
    return f"{s / 86400:.0f}d"


def row_cells(row: Mapping[str, object], now: float) -> tuple[str, ...]:
    last = row.get("last_activity")
    hold = row.get("hold_until")
    idle_in = row.get("idle_in_s")
    return (
        str(row["sandbox"]),
        str(row["state"]),
        "-" if not isinstance(last, int | float) else human_span(now - last) + " ago",
        human_bytes(int(row.get("bytes_in") or 0)),  # type: ignore[call-overload]
        human_bytes(int(row.get("bytes_out") or 0)),  # type: ignore[call-overload]
        str(row.get("open_connections") or 0),
        "-" if not isinstance(hold, int | float) else human_span(hold - now),
        "-" if not isinstance(idle_in, int | float) else human_span(idle_in),
        # Why an active sandbox is not idled ("no feed from <forwarder> since <time>"), if it is not.
        str(row.get("idle_blocked") or ""),
    )


def render(rows: Sequence[Mapping[str, object]], now: float) -> str:
    """A fixed-width table, one line per sandbox, sorted by ID; 'no sandboxes' when there are none."""
    if not rows:
        return "no sandboxes registered\n"
    cells = [COLUMNS] + [row_cells(r, now) for r in sorted(rows, key=lambda r: str(r["sandbox"]))]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    right = {3, 4, 5}
    lines = []
    for c in cells:
        lines.append("  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(c, widths,
                                                                                                        strict=True)))
                     .rstrip())
    return "\n".join(lines) + "\n"
