"""The replay report: one self-contained HTML page of plots, for people who
would rather look than read.

The series come from `report_series`; this module draws them. plotly.js is
inlined so the page opens offline, and the series themselves are embedded as
JSON for anyone who wants the numbers.
"""

from __future__ import annotations

import html
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable

# Above this many steps the page sums the per-step series into buckets of
# steps: a browser draws a few tens of thousands of points per figure well.
MAX_POINTS = 20_000

# "Blocks moved" and the tiers' panels draw at most this many bars in all, each summing a
# round number of steps (`bar_bin`): about 4 px a bar, gap included, on a 1400 px page.
MAX_BARS = 300
# Figure layout, in pixels from the top: the title's band, then the legend's, then the plot.
TITLE_TOP = 12
LEGEND_TOP = 42
PLOT_TOP = 92
# Margins in pixels, the same on every figure so that their step axes line up one under
# another: wide enough for the incidents' row names and a tier's right-hand axis.
MARGIN_LEFT = 110
MARGIN_RIGHT = 70
HEIGHT = 400
INCIDENTS_HEIGHT = 330
# Cache resets: a dashed line each on every step plot; labels at least 1/RESET_LABELS of the
# axis apart, so that they never pile up.
RESET_COLOR = "#8c564b"
RESET_LABELS = 12

# Request states in the timeline, in legend order: the engine's statuses.
STATUS_LABELS = {
    "waiting": "waiting",
    "loading": "waiting for a load",
    "running": "running",
    "preempted": "preempted",
    "aborting": "aborted, load ending",
}
STATUS_COLORS = {
    "waiting": "#bdbdbd", "loading": "#ff7f0e", "running": "#2ca02c", "preempted": "#d62728",
    "aborting": "#9467bd",
}
# Rows of the flushes-and-failures figure: (series name, label, color).
INCIDENTS = (
    ("flushes", "flushes", "#1f77b4"),
    ("cache_resets", "cache resets", "#8c564b"),
    ("store_failures", "store failures", "#ff7f0e"),
    ("load_failures", "load failures", "#d62728"),
    ("violations", "violations", "#000000"),
)


class ReportError(Exception):
    """The report cannot be written where asked."""


def check_report_path(path: str, *, source: str | None = None, force: bool = False) -> None:
    """Fail before a long replay, not after it, when the page could not be
    written, or would replace what it must not: the log it is made from, a
    device, FIFO, link or directory, or (without `force`) any existing file."""
    if not path:
        raise ReportError("the report needs a file name")
    if os.path.lexists(path):
        if source is not None and os.path.exists(source) and os.path.exists(path) and os.path.samefile(path, source):
            raise ReportError(f"{path} is the log being replayed; name a new file for the report")
        mode = os.lstat(path).st_mode
        if stat.S_ISDIR(mode):
            raise ReportError(f"{path} is a directory; name the report file")
        if not stat.S_ISREG(mode):
            raise ReportError(f"{path} exists and is not a regular file (a link, device or FIFO); "
                              f"name a new file for the report")
        if not force:
            raise ReportError(f"{path} exists; --force replaces it")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ReportError(f"cannot write {path}: no such directory {folder}")
    if not os.access(folder, os.W_OK):
        raise ReportError(f"cannot write {path}: directory {folder} is not writable")


def write_report(path: str, series: dict, *, source: str, max_points: int = MAX_POINTS, force: bool = False) -> int:
    """Write the page and return its size in bytes.

    An existing regular file at `path` is replaced only with `force`; never the
    log it is made from, and never a device, FIFO or link (`check_report_path`).
    The page is written to a temporary file and renamed, so a failed write never
    leaves half a page behind.
    """
    check_report_path(path, source=source, force=force)
    return write_page(path, render_html(series, source=source, max_points=max_points).encode())


def write_page(path: str, page: bytes) -> int:
    """Write a checked path's page through a temporary file and a rename; its size in bytes."""
    folder = os.path.dirname(path) or "."
    try:
        fd, temporary = tempfile.mkstemp(prefix=".kvledger-report-", suffix=".html", dir=folder)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(page)
            os.chmod(temporary, 0o644)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as exc:
        raise ReportError(f"cannot write {path}: {exc.strerror or exc}") from None
    return len(page)


def bucketed(series: dict, max_points: int = MAX_POINTS) -> tuple[dict, int]:
    """The per-step series summed over buckets of k steps so at most `max_points` remain, and k.

    Counts are summed; occupancy is the bucket's last value, so the final
    occupancy and every total are unchanged.
    """
    n = len(series["steps"])
    k = max(1, math.ceil(n / max_points))
    if k == 1:
        return series, 1
    out = dict(series)
    starts = range(0, n, k)
    out["steps"] = [series["steps"][i] for i in starts]
    out["used_slots"] = [series["used_slots"][min(i + k, n) - 1] for i in starts]
    for name in ("hit_tokens", "prompt_tokens_computed", "tokens_computed", "store_blocks", "load_blocks",
                 "keys_failed", *(name for name, _, _ in INCIDENTS)):
        out[name] = [sum(series[name][i:i + k]) for i in starts]
    if "lower_tiers" in series:
        out["lower_tiers"] = [
            {**tier, "held": [tier["held"][min(i + k, n) - 1] for i in starts],
             **{name: [sum(tier[name][i:i + k]) for i in starts] for name, _, _ in TIER_BARS}}
            for tier in series["lower_tiers"]]
    return out, k


def _cumulative(values: list[int]) -> list[int]:
    total, out = 0, []
    for value in values:
        total += value
        out.append(total)
    return out


def bar_bin(steps: list[int], series: int, max_bars: int = MAX_BARS) -> int:
    """How many steps one bar sums: the smallest of 1, 2, 5, 10, 20, 50, ... that draws the
    steps from the first to the last in at most `max_bars` bars, `series` bars a bin."""
    span = (steps[-1] - steps[0] + 1 if steps else 1) * series
    scale = 1
    while True:
        for multiple in (1, 2, 5):
            if span <= multiple * scale * max_bars:
                return multiple * scale
        scale *= 10


def binned(steps: list[int], width: int, columns: dict[str, list[int]]) -> tuple[list[float], list[list[int]], dict]:
    """The columns summed over bins of `width` steps from the first step: each bin's centre on
    the step axis, the first and last step it holds, and its sums (a bin with no step sums to 0)."""
    if not steps:
        return [], [], {name: [] for name in columns}
    first, last = steps[0], steps[-1]
    count = (last - first) // width + 1
    sums = {name: [0] * count for name in columns}
    for index, step in enumerate(steps):
        slot = (step - first) // width
        for name, values in columns.items():
            sums[name][slot] += values[index]
    centres = [first + slot * width + (width - 1) / 2 for slot in range(count)]
    spans = [[first + slot * width, min(first + (slot + 1) * width - 1, last)] for slot in range(count)]
    return centres, spans, sums


def _layout(title: str, height: int, **more: object) -> dict:
    """A figure's layout: the title in the top band, the legend in its own band under it (both
    placed in pixels from the top, so no legend covers a title at any figure height), the plot
    below them."""
    return {**dict(
        template="plotly_white", height=height, hovermode="x unified", showlegend=True,
        title=dict(text=title, x=0, xref="paper", xanchor="left", y=1, yref="container", yanchor="top",
                   pad=dict(t=TITLE_TOP)),
        legend=dict(orientation="h", x=0, xanchor="left", yref="container", y=1 - LEGEND_TOP / height,
                    yanchor="top"),
        margin=dict(l=MARGIN_LEFT, r=MARGIN_RIGHT, t=PLOT_TOP, b=50)), **more}


def _mark_resets(figure: object, resets: list[tuple[float, int]], x_range: list[float], *,
                 legend: bool = True) -> None:
    """A dashed line at each cache reset (it drops every block the tier holds), one legend entry
    for them all (from plotly 6.8, whose plotly.js hides a legend group's shapes together,
    clicking it hides them all), and a label at each one far enough from the last labelled one
    to be read."""
    lines, labels = [], []
    last_label, spacing = -math.inf, (x_range[1] - x_range[0]) / RESET_LABELS
    for index, (x, step) in enumerate(resets):
        lines.append(dict(
            type="line", x0=x, x1=x, xref="x", y0=0, y1=1, yref="paper", layer="above",
            line=dict(color=RESET_COLOR, width=1.5, dash="dash"), name=f"cache resets ({len(resets)})",
            legendgroup="cache resets", showlegend=legend and index == 0))
        if x - last_label >= spacing:
            last_label = x
            labels.append(dict(
                x=x, y=1, xref="x", yref="paper", text=f"reset, step {step}", showarrow=False, xanchor="left",
                yanchor="top", xshift=3, font=dict(size=11, color=RESET_COLOR), bgcolor="rgba(255,255,255,0.8)"))
    figure.update_layout(shapes=lines, annotations=labels)  # type: ignore[attr-defined]


def _figures(full: dict, series: dict, k: int) -> dict[str, object]:
    """The figures: step plots from `series` (bucketed by k), bars and request timelines from `full`.

    Every step plot spans the whole run, first step to last, so the panels line up
    one under another, and marks the cache resets."""
    import plotly.graph_objects as go  # only when a report is asked for: plotly takes a second to import

    steps = series["steps"]
    step_word = "step" if k == 1 else f"{k} steps"
    x_title = "scheduler step" if k == 1 else f"scheduler step (summed over buckets of {k} steps)"
    x_range = _step_range(full["steps"])
    position = _positions(full)
    resets = [(position(step, seq), step) for step, seq in full.get("resets", ())]
    width = bar_bin(full["steps"], len(TRANSFER_BARS))
    bar_word = "step" if width == 1 else f"{width} steps"
    figures: dict[str, object] = {}

    capacity = series["capacity_slots"]
    figure = go.Figure()
    figure.add_trace(go.Scatter(
        x=steps, y=series["used_slots"], name="used slots", mode="lines", line=dict(shape="hv"),
        fill="tozeroy", customdata=[round(100 * u / capacity, 1) for u in series["used_slots"]],
        hovertemplate="%{y} used (%{customdata}%)<extra></extra>"))
    figure.add_trace(go.Scatter(x=x_range if steps else [], y=[capacity, capacity] if steps else [],
                                name=f"capacity ({capacity} slots)", mode="lines",
                                line=dict(dash="dash", color="#555555"), hoverinfo="skip"))
    figure.update_layout(xaxis_title=x_title, yaxis_title="tier slots", yaxis_rangemode="tozero",
                         **_layout("Tier occupancy at the end of each step", HEIGHT))
    figures["occupancy"] = figure

    figure = go.Figure()
    for name, label, color, dash in (
            ("hit_tokens", "prompt tokens restored from the tier (hits)", "#2ca02c", "solid"),
            ("prompt_tokens_computed", "prompt tokens computed (misses)", "#d62728", "solid"),
            ("tokens_computed", "all tokens computed (prompt and decode)", "#7f7f7f", "dot")):
        figure.add_trace(go.Scatter(
            x=steps, y=_cumulative(series[name]), customdata=series[name], name=label, mode="lines",
            line=dict(color=color, dash=dash),
            hovertemplate=f"%{{y}} so far (+%{{customdata}} this {step_word})<extra></extra>"))
    figure.update_layout(xaxis_title=x_title, yaxis_title="tokens",
                         **_layout("Hits and misses (cumulative)", HEIGHT))
    figures["hits"] = figure

    # One bar per step of a long run is under a pixel wide: a reader of a long run needs to see
    # where the traffic and the failures were and how much, which sums over bins of a round
    # number of steps show at any length (the hover names each bar's steps; the embedded series
    # keeps every step).
    centres, spans, sums = binned(full["steps"], width, {name: full[name] for name, _, _ in TRANSFER_BARS})
    what = "%{y} blocks" if width == 1 else "%{y} blocks in steps %{customdata[0]} to %{customdata[1]}"
    figure = go.Figure()
    for name, label, color in TRANSFER_BARS:
        figure.add_trace(go.Bar(x=centres, y=sums[name], customdata=spans, name=label, marker_color=color,
                                hovertemplate=f"{what}<extra></extra>"))
    title = "Blocks moved per step" if width == 1 else f"Blocks moved per {width} steps"
    figure.update_layout(barmode="group", bargap=0.15, xaxis_title=_bar_axis(width),
                         yaxis_title=f"KV blocks per {bar_word}<br>(the log holds no byte sizes)",
                         **_layout(title, HEIGHT))
    figures["transfers"] = figure

    figure = go.Figure()
    for name, label, color in INCIDENTS:
        points = [(s, c) for s, c in zip(steps, series[name]) if c]
        figure.add_trace(go.Scatter(
            x=[s for s, _ in points], y=[label] * len(points), customdata=[c for _, c in points],
            name=f"{label} ({sum(series[name])})", mode="markers",
            marker=dict(color=color, symbol="line-ns-open" if name == "flushes" else "circle",
                        size=[min(24, 7 + 3 * math.sqrt(c)) for _, c in points], line=dict(width=2)),
            hovertemplate=f"%{{customdata}} {label}<extra>step %{{x}}</extra>"))
    figure.update_layout(xaxis_title=x_title,
                         **_layout("Flushes and failures", INCIDENTS_HEIGHT, hovermode="closest"))
    # Every row, and the whole run, even where a log has one mark (or none).
    figure.update_yaxes(categoryorder="array", categoryarray=[label for _, label, _ in reversed(INCIDENTS)],
                        range=[-0.5, len(INCIDENTS) - 0.5])
    figures["incidents"] = figure

    timelines = full["requests"]["timelines"]
    figure = go.Figure()
    for status, label in STATUS_LABELS.items():
        bars = [(t["request_id"], s, position(s["start"], s["start_seq"]), position(s["end"], s["end_seq"]))
                for t in timelines for s in t["segments"] if s["status"] == status]
        figure.add_trace(go.Bar(
            y=[rid for rid, _, _, _ in bars], x=[end - start for _, _, start, end in bars],
            base=[start for _, _, start, _ in bars], orientation="h", name=label,
            marker_color=STATUS_COLORS[status], customdata=[[s["start"], s["end"]] for _, s, _, _ in bars],
            hovertemplate=f"%{{y}}: {label}, steps %{{customdata[0]}} to %{{customdata[1]}}<extra></extra>"))
    for end, symbol, color in (("finished", "line-ns-open", "#000000"), ("aborted", "x", "#d62728")):
        ended = [t for t in timelines if t["end"] == end]
        figure.add_trace(go.Scatter(
            y=[t["request_id"] for t in ended], x=[position(t["end_step"], t["end_seq"]) for t in ended],
            customdata=[t["end_step"] for t in ended], mode="markers", name=end,
            marker=dict(symbol=symbol, color=color, size=9, line=dict(width=2)),
            hovertemplate=f"%{{y}}: {end} at step %{{customdata}}<extra></extra>"))
    figure.update_layout(
        barmode="overlay", xaxis_title="scheduler step",
        **_layout("Requests over steps", max(300, PLOT_TOP + 60 + 14 * len(timelines)), hovermode="closest"))
    # The first request at the top, and no padding above or below the rows.
    figure.update_yaxes(type="category", automargin=True, categoryorder="array",
                        categoryarray=[t["request_id"] for t in timelines], range=[len(timelines) - 0.5, -0.5])
    requests_range = x_range
    if full["requests"]["total"] > len(timelines) and timelines:
        # Only the first requests are drawn: the panel ends where they do, or their bars
        # would be slivers at the start of a long run.
        drawn_end = max(position(s["end"], s["end_seq"]) for t in timelines for s in t["segments"])
        requests_range = [x_range[0], min(x_range[1], drawn_end + 0.5)]
    figures["requests"] = figure
    figures["misses"] = _misses_figure(full)
    for index, tier in enumerate(series.get("lower_tiers", ()), start=1):
        full_tier = full["lower_tiers"][index - 1]
        figures[f"tier-{index}"] = _tier_figure(tier, full_tier, steps, full["steps"])
    for name, figure in figures.items():
        shown = requests_range if name == "requests" else x_range
        figure.update_xaxes(range=shown)  # type: ignore[attr-defined]
        _mark_resets(figure, [(x, step) for x, step in resets if shown[0] <= x <= shown[1]], shown,
                     legend=name != "incidents")  # that one has its own row of resets
    return figures


TRANSFER_BARS = (("store_blocks", "stored (device to tier, started)", "#1f77b4"),
                 ("load_blocks", "loaded (tier to device, started)", "#2ca02c"),
                 ("keys_failed", "failed keys (stores and loads)", "#d62728"))
TIER_BARS = (("keys_written", "written (write-through)", "#1f77b4"),
             ("keys_read", "promoted towards the device", "#2ca02c"),
             ("keys_found", "found (at start, or written by another process)", "#9467bd"),
             ("evictions", "evicted (capacity, or a reset)", "#ff7f0e"),
             ("read_failures", "failed reads (recomputed)", "#d62728"),
             ("write_failures", "failed writes", "#8c564b"))


# A color per cause, the same on every page; computed-by-design last, in grey.
MISS_COLORS = {
    "first_seen": "#1f77b4", "evicted": "#ff7f0e", "reset": "#9467bd", "transfer_failed": "#d62728",
    "store_failed": "#e377c2", "not_admitted": "#8c564b", "stored_too_late": "#bcbd22",
    "not_computed_yet": "#17becf", "request_ended": "#aec7e8", "lazy_not_offloaded": "#ffbb78",
    "after_gap": "#98df8a", "bounded_by_group": "#c5b0d5", "no_host_slot": "#c49c94", "load_failed": "#ff9896",
    "log_table": "#dbdb8d", "unexplained": "#000000", "partial_block": "#c7c7c7",
    "promotion_failed": "#f7b6d2", "tier_down": "#393b79", "lookup_timed_out": "#637939", "lookup_dropped": "#8c6d31",
    "below_store_threshold": "#843c39", "decode_not_offloaded": "#7b4173", "load_slower_than_compute": "#e7ba52",
    "spill_dropped": "#5254a3",
}


def _misses_figure(full: dict) -> object:
    """Computed prompt tokens by cause, in bins of steps, stacked."""
    import plotly.graph_objects as go  # only when a report is asked for: plotly takes a second to import

    by_cause = full["misses"]["by_cause"]
    causes = sorted(by_cause, key=lambda c: (c == "partial_block", -sum(by_cause[c])))
    width = bar_bin(full["steps"], 1)
    centres, spans, sums = binned(full["steps"], width, by_cause)
    what = "%{y} tokens" if width == 1 else "%{y} tokens in steps %{customdata[0]} to %{customdata[1]}"
    figure = go.Figure()
    for cause in causes:
        figure.add_trace(go.Bar(x=centres, y=sums[cause], customdata=spans, name=f"{cause} ({sum(by_cause[cause])})",
                                marker_color=MISS_COLORS.get(cause, "#7f7f7f"),
                                hovertemplate=f"{cause}: {what}<extra></extra>"))
    bar_word = "step" if width == 1 else f"{width} steps"
    figure.update_layout(barmode="stack", bargap=0.15, xaxis_title=_bar_axis(width),
                         yaxis_title=f"computed prompt tokens per {bar_word}",
                         **_layout("Why prompt tokens were computed, not restored", HEIGHT))
    return figure


def _tier_figure(tier: dict, full_tier: dict, steps: list[int], all_steps: list[int]) -> object:
    """One tier below host memory: blocks held (line), and what moved (bars, summed over bins of steps)."""
    import plotly.graph_objects as go  # only when a report is asked for: plotly takes a second to import

    width = bar_bin(all_steps, len(TIER_BARS))
    bar_word = "step" if width == 1 else f"{width} steps"
    centres, spans, sums = binned(all_steps, width, {name: full_tier[name] for name, _, _ in TIER_BARS})
    what = "%{y}" if width == 1 else "%{y} in steps %{customdata[0]} to %{customdata[1]}"
    figure = go.Figure()
    for name, label, color in TIER_BARS:
        figure.add_trace(go.Bar(x=centres, y=sums[name], customdata=spans, name=f"{label} ({sum(tier[name])})",
                                marker_color=color, yaxis="y2", hovertemplate=f"{what}<extra></extra>"))
    figure.add_trace(go.Scatter(x=steps, y=tier["held"], name=f"blocks held (capacity {tier['capacity_blocks']})",
                                mode="lines", line=dict(shape="hv", color="#333333")))
    figure.update_layout(xaxis_title=_bar_axis(width), yaxis=dict(title="blocks held", rangemode="tozero"),
                         yaxis2=dict(title=f"blocks per {bar_word}", overlaying="y", side="right",
                                     rangemode="tozero"),
                         barmode="group", bargap=0.15,
                         **_layout(f"Tier {tier['name']}: blocks held, and blocks moved per {bar_word}", HEIGHT))
    return figure


def _bar_axis(width: int) -> str:
    return "scheduler step" if width == 1 else f"scheduler step (each bar sums {width} steps)"


def _step_range(steps: list[int]) -> list[float]:
    """The step axis of every step plot: the first step's column to the last's."""
    return [steps[0] - 0.5, steps[-1] + 0.5] if steps else [-0.5, 0.5]


def _positions(series: dict) -> Callable[[int, int | None], float]:
    """Where an event sits on the step axis: in its step's column (step - 0.5 to step + 0.5,
    where the step plots draw that step), at its place among the step's events.

    Several transitions can happen in one step (a load admitted and failed
    at once); spreading them over the step keeps each one visible.
    """
    columns = dict(zip(series["steps"], series["seq_ranges"]))
    end = (series["steps"][-1] + 0.5) if series["steps"] else 0.5

    def position(step: int, seq: int | None) -> float:
        if seq is None:
            return end
        first, last = columns[step]
        return step - 0.5 + (seq - first) / (last - first + 1)

    return position


def script_json(text: str) -> str:
    """JSON text that cannot end the <script> element it sits in (request ids come from the log)."""
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1400px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
.note { color: #555; }
table { border-collapse: collapse; margin: 8px 0 16px; }
td, th { padding: 2px 12px 2px 0; text-align: left; font-variant-numeric: tabular-nums; }
.problem { color: #b00020; font-weight: 600; }
.figure { margin: 12px 0 28px; }
"""

DRAW = """
for (const data of document.querySelectorAll('script.kvledger-figure')) {
  const figure = JSON.parse(data.textContent);
  Plotly.newPlot(data.dataset.target, figure.data, figure.layout,
                 {responsive: true, displaylogo: false});
}
"""


def render_html(series: dict, *, source: str, max_points: int = MAX_POINTS) -> str:
    """One self-contained page: the summary, the five figures, and the series as JSON."""
    from plotly.offline import get_plotlyjs  # only when a report is asked for, as the figures

    shown, k = bucketed(series, max_points)
    figures = _figures(series, shown, k)
    width = bar_bin(series["steps"], len(TRANSFER_BARS))
    totals, config, outcome = series["totals"], series["config"], series["replay"]
    requests = series["requests"]
    problem = outcome["first_problem"]
    e = html.escape
    groups = ", ".join(f"{g['kind']} ({g['block_size']} tokens{', window ' + str(g['window']) if g['window'] else ''})"
                       for g in config["groups"])
    rows = [
        ("events", f"{outcome['events']} in {outcome['steps']} steps (last seq {outcome['last_seq']})"),
        ("KV groups", groups),
        ("tier", f"{config['num_tier_slots']} slots; {config['num_device_blocks']} device blocks; policy "
                 f"{config['policy']}, protection {config['protection']}, store mode "
                 f"{config.get('store_mode', 'eager')}, one store job per {config.get('store_jobs', 'request')}, "
                 f"{config['world_size']} worker(s)"),
        ("hits", f"{totals['hit_tokens']} tokens restored by {totals['loads']} loads ({totals['keys_loaded']} blocks)"),
        ("stores", f"{totals['stores']} jobs, {totals['keys_stored']} blocks stored, "
                   f"{totals['store_rejections']} not admitted (tier full)"),
        ("failures", f"{totals['store_failures']} stores, {totals['load_failures']} loads, "
                     f"{totals['keys_failed']} keys dropped"),
        ("flushes", f"{totals['flushes']} ({totals['jobs_flushed']} jobs waited for)"),
        ("requests", f"{requests['total']} added, {totals['finished']} finished, {totals['aborted']} aborted, "
                     f"{totals['preemptions']} preemptions"),
        ("digests", f"{outcome['digests_checked']} checked"),
    ]
    missed = series["misses"]["totals"]
    if missed["missed_by_cause"]:
        causes = ", ".join(f"{cause} {entry['tokens']}" for cause, entry in missed["missed_by_cause"].items())
        rows.insert(4, ("computed", f"{missed['missed_tokens']} prompt tokens of {missed['admissions']} admissions "
                                    f"were computed: {causes}"))
    for tier in series.get("lower_tiers", ()):
        rows.insert(-1, (f"tier {tier['name']}", (
            f"{tier['held'][-1] if tier['held'] else 0}/{tier['capacity_blocks']} blocks held; "
            f"{sum(tier['keys_written'])} written ({sum(tier['write_failures'])} failed), "
            f"{sum(tier['keys_read'])} promoted ({sum(tier['read_failures'])} failed), "
            f"{sum(tier['keys_found'])} found, {sum(tier['evictions'])} evicted")))
    table = "\n".join(f"<tr><th>{e(name)}</th><td>{e(value)}</td></tr>" for name, value in rows)
    if problem is None:
        verdict = '<p>Replay result: ok.</p>'
    else:
        verdict = (f'<p class="problem">First problem at seq {problem["seq"]} ({e(problem["kind"])}): '
                   f'{e(problem["detail"])}. The plots stop where the replay stopped.</p>')
    if requests["total"] > len(requests["timelines"]):
        drawn = (f"Showing the first {len(requests['timelines'])} of {requests['total']} requests, in arrival "
                 f"order (at most {requests['max_drawn']} are drawn); the panel ends where they do.")
    else:
        drawn = f"All {requests['total']} requests, in arrival order."
    notes = {
        "occupancy": "Used slots include slots still being written by a store.",
        "hits": "Restored tokens are a request's prompt prefix loaded from the tier, counted when the load "
                "is admitted (a load that fails is computed again, and counts as computed too). Computed "
                "prompt tokens are prompt positions the forward pass computed, recomputation after a "
                "preemption included. Hover for the per-step numbers.",
        "transfers": "Counted in KV blocks (one block of one KV group each): the event log records no byte "
                     "sizes. Stores are counted when started, loads when admitted." + (
                         f" Each bar sums {width} steps (at most {MAX_BARS} bars a figure, so that a long run "
                         f"stays readable); hover for its steps." if width > 1 else ""),
        "incidents": "One mark per step with at least one; its size grows with the count (hover for it).",
        "requests": "Each bar is a request's state in the engine; transitions within one step are spread "
                    "over it in event order. " + drawn,
        "misses": "Each admission's computed prompt tokens (vLLM's own prefix cache and kvledger's hits "
                  "aside), by the fact that kept them from being restored, counted at the step the request "
                  "was admitted: `kvledger explain LOG` names each block's cause with its seq; partial_block "
                  "is computed by design (the prompt's partial last block and last token).",
    }
    bucket_note = (f'<p class="note">This log has {len(series["steps"])} steps: the step plots sum them in '
                   f'buckets of {k} steps. The embedded series keep every step.</p>' if k > 1 else "")
    resets = len(series.get("resets", ()))
    reset_note = (f'<p class="note">Dashed lines on the step plots mark the {resets} cache '
                  f'reset{"s" if resets > 1 else ""}: each drops every block the tier holds.</p>' if resets else "")
    for index in range(1, len(series.get("lower_tiers", ())) + 1):
        notes[f"tier-{index}"] = (
            "A tier below host memory. Blocks are written through when their host store succeeds, and "
            "promoted (read into host memory, then copied to the device) when a hit needs a block only "
            "this tier holds. A failed read drops the block, which is recomputed.")
    sections = []
    for name, figure in figures.items():
        sections.append(
            f'<div class="figure"><div id="plot-{name}"></div>'
            f'<p class="note">{e(notes[name])}</p>'
            f'<script type="application/json" class="kvledger-figure" id="figure-{name}" '
            f'data-target="plot-{name}">{script_json(figure.to_json())}</script></div>')  # type: ignore[attr-defined]
    body = "\n".join(sections)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>kvledger report: {e(os.path.basename(source))}</title>
<style>{STYLE}</style>
<script>{get_plotlyjs()}</script>
</head>
<body>
<h1>kvledger replay report</h1>
<p class="note">{e(source)}</p>
{verdict}
<table>
{table}
</table>
{bucket_note}
{reset_note}
{body}
<script type="application/json" id="kvledger-series">{script_json(json.dumps(series, separators=(",", ":")))}</script>
<script>{DRAW}</script>
</body>
</html>
"""
