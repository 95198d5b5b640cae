"""The target forward's cost as a function of its rows, measured from the batches.

Under load a verification's cost is the batch's forward, and what a session's γ adds to it
is rows: every batched session feeds its pending tokens plus its draft. Each VerifyResponse
reports the forward's compute time and its rows (`batch_tokens`), so the orchestrator
learns the curve the hardware really has instead of assuming one. On a CPU it is far
from linear (`make bench`'s step costs, 2026-12-01 19:53 UTC, benchmarks/RESULTS.md at
88f9cce): at batch 4 going from 4 to 8 rows cost 3.7 ms of a 10.5 ms step and from 8 to
20 rows 1.0 ms more, the matrix kernels changing shape at the first extra row; at batch
16, 16 → 48 rows cost 4.6 ms and 48 → 112 rows 19 ms. A constant per-token slope from one
machine misjudges both.

Rows are pooled into buckets (exact up to 8, then about a quarter apart); each bucket keeps
decayed means of its rows and its times, so a point sits where its observations were, and
the curve between points is linear. The curve never falls with more rows (a running
maximum over the points: noise does not make tokens free), and above the last point it
rises with the steeper of its last segment and its mean slope, so that an unmeasured
region is never cheaper than the measured one suggests. That guess can be far too dear
where the points are few and low (rows 1 → 2, the kernel's jump, taken as the slope of
every row after), so the γ policy prices rows above `top()` at no more than its
linear model would (`CostModel._loaded_verify`). One curve per orchestrator
process: the replicas of a pool are taken to be alike. `specdec_target_forward_ms{rows}`
exports the buckets' times.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128,
           160, 192, 224, 256)
POINT_AFTER = 3  # observations before a bucket is a point of the curve
WEIGHT = 0.1  # decay of a bucket's means: recent batches count most


def bucket_of(rows: int) -> int:
    """The largest bucket at or below `rows` (rows above the last share the last bucket)."""
    return BUCKETS[max(0, bisect.bisect_right(BUCKETS, rows) - 1)]


@dataclass
class _Point:
    rows: float
    ms: float
    count: int = 1

    def update(self, rows: int, ms: float) -> None:
        self.rows += WEIGHT * (rows - self.rows)
        self.ms += WEIGHT * (ms - self.ms)
        self.count += 1


@dataclass
class ForwardCosts:
    """Shared by the sessions of one orchestrator: ms of a target forward of R rows."""
    points: dict[int, _Point] = field(default_factory=dict)

    def observe(self, rows: int, compute_ms: float) -> None:
        if rows < 1 or not compute_ms > 0:
            return  # a replica that reports no rows (an older one) or no time
        key = bucket_of(rows)
        point = self.points.get(key)
        if point is None:
            self.points[key] = _Point(float(rows), compute_ms)
        else:
            point.update(rows, compute_ms)

    def table(self) -> dict[int, float]:
        """{bucket: decayed mean ms} of every bucket, measured enough or not (for /metrics;
        read from the metrics thread, hence the one-step copy of the dict)."""
        return {key: point.ms for key, point in dict(self.points).items()}

    def curve(self) -> list[tuple[float, float]]:
        """[(rows, ms)] of the measured points, rows ascending, ms non-decreasing."""
        pts = sorted((p.rows, p.ms) for p in self.points.values() if p.count >= POINT_AFTER)
        out, top = [], 0.0
        for rows, ms in pts:
            top = max(top, ms)
            out.append((rows, top))
        return out

    def top(self) -> tuple[float, float] | None:
        """The curve's last point, (rows, ms), or None with none: above it the curve is a guess."""
        pts = self.curve()
        return pts[-1] if pts else None

    def ms(self, rows: float) -> float | None:
        """The forward's time at `rows`, or None while fewer than two points are measured
        (one point says nothing about what more rows cost)."""
        pts = self.curve()
        if len(pts) < 2:
            return None
        xs = [x for x, _ in pts]
        if rows <= xs[0]:
            return pts[0][1]
        i = bisect.bisect_left(xs, rows)
        if i < len(pts):
            (x0, y0), (x1, y1) = pts[i - 1], pts[i]
            return y0 + (y1 - y0) * (rows - x0) / (x1 - x0) if x1 > x0 else y1
        (xa, ya), (xb, yb) = pts[-2], pts[-1]
        last = (yb - ya) / (xb - xa) if xb > xa else 0.0
        mean = (yb - pts[0][1]) / (xb - xs[0]) if xb > xs[0] else 0.0
        return yb + max(last, mean) * (rows - xb)
