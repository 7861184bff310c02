"""Plain-text tables, sizes and strategy summaries, for the command line and the report."""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from strategy_space import PS, ModelSpec, Strategy
from strategy_space.builders import step_bytes
from strategy_space.strategy import shard_bounds


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def human_count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[int] = ()) -> str:
    """Format rows under headers; columns whose index is in ``right`` are right-aligned."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def headline(error: str | None) -> str:
    """An error's first line for a table cell: a ConfigError of several problems ("3 problems:"
    then one per line) is headed by its first problem and how many more."""
    lines = [line.strip() for line in (error or "").strip().splitlines()]
    if not lines:
        return ""
    count = lines[0].split(" ")[0]
    if len(lines) > 1 and lines[0] == f"{count} problems:" and count.isdigit():
        first = lines[1][2:] if lines[1].startswith("- ") else lines[1]
        more = int(count) - 1
        return first + (f" (and {more} more)" if more > 0 else "")
    return lines[0]


# Past this many shards the destination/group cell names the first and last few and how many
# distinct: a variable over 512 nodes would otherwise be a 3,000-character cell.
SHOWN_SHARDS = 8


def _elided(where: list[str]) -> str:
    if len(where) <= SHOWN_SHARDS:
        return ",".join(where)
    distinct = len(set(where))
    return (",".join(where[:3]) + ",...," + ",".join(where[-2:])
            + f" ({distinct} distinct)")


def describe_strategy(strategy: Strategy, model: ModelSpec | None) -> tuple[list[tuple], dict[str, float], dict[int, float]]:
    """Rows of the ``show`` table plus bytes per PS node and per AR group (per worker-step)."""
    rows = []
    ps_bytes: dict[str, float] = defaultdict(float)
    group_bytes: dict[int, float] = defaultdict(float)
    for cfg in strategy.variables:
        var = model.var(cfg.name) if model is not None and cfg.name in model.names else None
        if var is not None and cfg.partitioned and cfg.axis < len(var.shape):
            bounds = shard_bounds(var.shape[cfg.axis], cfg.num_shards)
            fractions = [(b - a) / var.shape[cfg.axis] for a, b in bounds]
        else:
            fractions = [1.0 / cfg.num_shards] * cfg.num_shards
        moved = step_bytes(var) if var is not None else None
        where, comps = [], set()
        kinds = {type(s).__name__ for s in cfg.synchronizers}
        for frac, sync in zip(fractions, cfg.synchronizers):
            if isinstance(sync, PS):
                where.append(sync.destination)
                if moved is not None:
                    ps_bytes[sync.destination] += moved * frac
            else:
                where.append(f"g{sync.group}")
                comps.add(sync.compressor)
                if moved is not None:
                    group_bytes[sync.group] += moved * frac
        first = cfg.synchronizers[0]
        extra = ""
        if isinstance(first, PS):
            extra = ("local-repl " if first.local_replication else "") + (
                f"stale={first.staleness}" if first.sync else "async")
        sync_name = "/".join(sorted("PS" if k == "PS" else "AR" for k in kinds))
        rows.append((
            cfg.name,
            human_bytes(var.bytes) if var is not None else "?",
            ("sparse" if var.sparse else "dense") if var is not None else "?",
            sync_name,
            cfg.num_shards if cfg.partitioned else 1,
            _elided(where),
            ",".join(sorted(comps)) or "-",
            extra.strip() or "-",
        ))
    return rows, dict(ps_bytes), dict(group_bytes)
