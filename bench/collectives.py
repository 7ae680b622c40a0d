"""Which all-reduce the cost model picks, over worker counts and message sizes.

Issue 16: "which collective the cost model picks across worker counts 2..1024
and message sizes 1 KB..1 GB on 10 Gbps". For every worker count of
:data:`gradcomp.sim.collectives.TABLE_WORKERS` and bytes per worker of
:data:`~gradcomp.sim.collectives.TABLE_BYTES`, the cheapest flat all-reduce
(ring, recursive halving/doubling, binomial tree) under the alpha-beta model
of :mod:`gradcomp.sim.collectives` (survey 004 §2.4; Thakur et al. 2005),
its time, and the ring's. The last column is the size from which the ring
beats halving/doubling: each price is affine in the bytes, ``L + v B``, so
the two cross at ``(L_ring - L_rhd) / (v_rhd - v_ring)``; on a power of two
their ``v`` are equal and halving/doubling, with fewer latencies, is never
beaten.

Pure arithmetic (no JAX, no timing): ``python -m bench collectives``
prints the table in well under a second and writes ``collectives.json`` and
``collectives.md`` to ``--out``; ``--bandwidth-gbps`` and ``--latency-us``
choose the link (default 10 Gbit/s, 25 us per message).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.output import write_json
from gradcomp.sim import collectives

#: Short names of the flat algorithms in the table's cells.
SHORT = {
  "ring": "ring",
  "recursive_halving_doubling": "RHD",
  "binary_tree": "tree",
}


def link(bandwidth_gbps: float, latency_us: float) -> tuple[float, float]:
  """``(alpha, beta)`` in seconds and seconds per byte of a link.

  As :class:`gradcomp.sim.Cluster` reads its own: ``alpha = latency_us * 1e-6``,
  ``beta = 8 / (bandwidth_gbps * 1e9)``.
  """
  if not bandwidth_gbps > 0 or bandwidth_gbps == float("inf"):
    raise ValueError(f"bandwidth_gbps must be finite and > 0, got {bandwidth_gbps!r}")
  if not 0 <= latency_us < float("inf"):
    raise ValueError(f"latency_us must be finite and >= 0, got {latency_us!r}")
  return latency_us * 1e-6, 8.0 / (bandwidth_gbps * 1e9)


def ring_crossover(n: int, alpha: float, beta: float) -> float | None:
  """Bytes from which the ring is cheaper than halving/doubling on ``n`` workers.

  Both prices are affine in the bytes, ``L + v B`` (``L`` the price of no
  bytes, ``v`` of one more byte); ``0.0`` if the ring is never dearer,
  ``None`` if it never wins (``n`` a power of two: equal ``v``, and
  halving/doubling has fewer latencies).
  """
  ring, rhd = collectives.ring_allreduce, collectives.recursive_halving_doubling
  lat_ring, lat_rhd = ring(n, 0.0, alpha, beta), rhd(n, 0.0, alpha, beta)
  v_ring, v_rhd = ring(n, 1.0, 0.0, beta), rhd(n, 1.0, 0.0, beta)
  if v_rhd <= v_ring:
    return 0.0 if lat_ring <= lat_rhd else None
  return max(0.0, (lat_ring - lat_rhd) / (v_rhd - v_ring))


def _seconds(s: float) -> str:
  if s < 1e-3:
    return f"{s * 1e6:.3g} us"
  if s < 1.0:
    return f"{s * 1e3:.3g} ms"
  return f"{s:.3g} s"


def _bytes(b: float) -> str:
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if b >= scale:
      return f"{b / scale:.3g} {unit}"
  return f"{b:.3g} B"


def render(result: dict[str, Any]) -> str:
  """The markdown table of :func:`run`'s result."""
  rows, sizes = result["rows"], result["sizes"]
  cells = {(r["workers"], r["nbytes"]): r for r in rows}
  lines = [
    f"Cheapest flat all-reduce per worker count (rows) and bytes per worker "
    f"(columns), alpha-beta model at {result['bandwidth_gbps']:g} Gbit/s and "
    f"{result['latency_us']:g} us per message. Cell: the winner (RHD = "
    f"recursive halving/doubling = Rabenseifner, tree = binomial tree) and its "
    f"time; the ring's time beside it when the ring loses. Ties go to the ring. "
    f"Last column: the size from which the ring beats RHD.",
    "",
    "| workers | " + " | ".join(_bytes(b) for b in sizes) + " | ring from |",
    "| ---: | " + " | ".join("---" for _ in sizes) + " | ---: |",
  ]
  for n in result["workers"]:
    row = []
    for b in sizes:
      r = cells[(n, b)]
      cell = f"{SHORT[r['best']]} {_seconds(r['seconds'])}"
      if r["best"] != "ring":
        cell += f" (ring {_seconds(r['prices']['ring'])})"
      row.append(cell)
    cross = result["ring_from"][str(n)]
    cross = "never" if cross is None else "always" if cross == 0 else _bytes(cross)
    lines.append(f"| {n} | " + " | ".join(row) + f" | {cross} |")
  wins = {}
  for r in rows:
    wins[r["best"]] = wins.get(r["best"], 0) + 1
  lines.append("")
  lines.append(
    "Wins: "
    + ", ".join(f"{SHORT[k]} {wins.get(k, 0)}" for k in collectives.FLAT)
    + f" of {len(rows)} cells."
  )
  return "\n".join(lines)


def tabulate(
  bandwidth_gbps: float = 10.0,
  latency_us: float = 25.0,
  workers: Sequence[int] = collectives.TABLE_WORKERS,
  sizes: Sequence[float] = collectives.TABLE_BYTES,
) -> dict[str, Any]:
  """:func:`run`'s result without its wall time: the table as plain data."""
  alpha, beta = link(bandwidth_gbps, latency_us)
  rows = collectives.allreduce_table(alpha, beta, workers, sizes)
  return {
    "bandwidth_gbps": bandwidth_gbps,
    "latency_us": latency_us,
    "alpha": alpha,
    "beta": beta,
    "workers": [int(n) for n in workers],
    "sizes": [float(b) for b in sizes],
    "rows": rows,
    "ring_from": {str(n): ring_crossover(int(n), alpha, beta) for n in workers},
  }


def run(
  bandwidth_gbps: float = 10.0,
  latency_us: float = 25.0,
  workers: Sequence[int] = collectives.TABLE_WORKERS,
  sizes: Sequence[float] = collectives.TABLE_BYTES,
  out_dir: str = "bench_out/",
) -> dict[str, Any]:
  """Tabulates, prints and saves :func:`gradcomp.sim.collectives.allreduce_table`.

  Args:
    bandwidth_gbps: per-link bandwidth, Gbit/s, finite and > 0.
    latency_us: start-up latency per message, microseconds, finite and >= 0.
    workers: worker counts, integers >= 1.
    sizes: bytes per worker, >= 0.
    out_dir: where ``collectives.json`` and ``collectives.md`` go.

  Returns:
    ``{"bandwidth_gbps", "latency_us", "alpha", "beta", "workers", "sizes",
    "rows", "ring_from", "wall_s"}``; ``rows`` as ``allreduce_table``'s,
    ``ring_from`` the :func:`ring_crossover` bytes per worker count (keys
    are strings, as in the JSON).
  """
  start = time.perf_counter()
  result = tabulate(bandwidth_gbps, latency_us, workers, sizes)
  result["wall_s"] = time.perf_counter() - start
  table = render(result)
  print(table)
  path = write_json(out_dir, "collectives.json", result)
  Path(out_dir, "collectives.md").write_text(table + "\n")
  print(f"\nwrote {path}, collectives.md")
  return result
