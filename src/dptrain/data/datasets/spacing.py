"""The time spacing of a series' labels, and the seasonal periods it implies.

    from dptrain.data.datasets.spacing import season_candidates, time_step

    time_step(["2024-01-01T00:00", "2024-01-01T01:00", ...])   # 3600 (seconds), or None
    season_candidates(times)                                    # (24, 168): a day, a week

Times are labels (docs/tutorials/forecasting.md): ISO dates and date-times (`2024-01-31`,
`2024-01-31T13:00`, `2024-01-31 13:00`) have a spacing; numbers and other text do not, and a
series of them has no season unless `--season` gives one.
"""

from __future__ import annotations

import numpy as np

HOUR, DAY, WEEK = 3600, 86400, 7 * 86400


def parse_times(times: list[str]) -> np.ndarray | None:
    """The labels as datetime64[s], or None if one of them is not an ISO date or date-time
    (numbers are not: "3" would read as the year 3)."""
    if not times or any(t.replace(".", "", 1).lstrip("-").isdigit() for t in times):
        return None
    try:
        return np.array([np.datetime64(t.replace(" ", "T"), "s") for t in times])
    except ValueError:
        return None


def time_step(times: list[str]) -> int | None:
    """The most common spacing between consecutive labels, in seconds (None: no dates)."""
    parsed = parse_times(times)
    if parsed is None or len(parsed) < 2:
        return None
    gaps = np.diff(parsed).astype(np.int64)
    values, counts = np.unique(gaps, return_counts=True)
    step = int(values[counts.argmax()])
    return step if step > 0 else None


def season_candidates(times: list[str]) -> tuple[int, ...]:
    """The seasonal periods, in time steps, a forecaster tries for this spacing, shortest
    first: below a day, a day and a week ((24, 168) for hourly values); daily values, a week
    and a year (7, 365); weekly 52; monthly 12; quarterly 4. () when the spacing is unknown or
    fits none of these."""
    step = time_step(times)
    if step is None:
        return ()
    if step < DAY and DAY % step == 0:
        return (DAY // step, WEEK // step)
    if step == DAY:
        return (7, 365)
    if step == WEEK:
        return (52,)
    days = step / DAY
    if 28 <= days <= 31:
        return (12,)
    if 89 <= days <= 92:
        return (4,)
    return ()
