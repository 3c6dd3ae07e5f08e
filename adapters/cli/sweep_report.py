"""`kvledger whatif LOG --sweep --report PATH`: the sweep as curves, for people
sizing host memory by eye.

Two figures over host capacity (slots, and bytes where the log records a
slot's size): the hit tokens under LRU and ARC, the recorded point marked and
the one-pass LRU estimate beside them; and the blocks each point stores, loads
and writes to each tier below host memory (bytes on the hover where known).
plotly.js is inlined, as in the replay report, so the page opens offline.
"""

from __future__ import annotations

import html
import json
import os

from .report import DRAW, MARGIN_LEFT, MARGIN_RIGHT, STYLE, check_report_path, script_json, write_page

HEIGHT = 460
POLICY_COLORS = {"lru": "#1f77b4", "arc": "#ff7f0e"}
MOVED_DASH = {"stored": "solid", "loaded": "dot"}  # spills to tier N: "dash"


def write_sweep_report(path: str, data: dict, *, source: str, force: bool = False) -> int:
    check_report_path(path, source=source, force=force)
    return write_page(path, render_sweep_html(data, source=source).encode())


def render_sweep_html(data: dict, *, source: str) -> str:
    from plotly.offline import get_plotlyjs  # only when a page is asked for

    sweep = data["sweep"]
    figures = {"hits": _hits_figure(sweep), "moved": _moved_figure(sweep)}
    recorded = sweep["recorded"]
    e = html.escape
    size = f", {recorded['slot_bytes']} bytes a slot" if recorded["slot_bytes"] else ""
    notes = {
        "hits": "Each point is the log's traffic driven through the engine again at that host capacity "
                "(`kvledger whatif`: vLLM's schedule and the transfers' timing kept as recorded). The "
                "diamond is what the log recorded; the dotted line, where drawn, LRU's one-pass estimate "
                "from the keys' stack distances. Past the last point every key the log names fits.",
        "moved": "Blocks (one KV block of one group each) the engine stores into host memory, loads from it "
                 "and writes to each tier below it, at each capacity, under each policy"
                 + (f"; at {recorded['slot_bytes']} bytes a block on the hover" if recorded["slot_bytes"] else "")
                 + ".",
    }
    sections = "\n".join(
        f'<div class="figure"><div id="plot-{name}"></div><p class="note">{e(notes[name])}</p>'
        f'<script type="application/json" class="kvledger-figure" data-target="plot-{name}">'
        f'{script_json(json.dumps(figure))}</script></div>' for name, figure in figures.items())
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>kvledger whatif sweep: {e(os.path.basename(source))}</title>
<style>{STYLE}</style>
<script>{get_plotlyjs()}</script>
</head>
<body>
<h1>kvledger whatif: hits against host capacity</h1>
<p class="note">{e(source)}: recorded at {recorded['num_tier_slots']} host slots{e(size)}, policy
{e(recorded['policy'])}, {recorded['hit_tokens']} hit tokens.</p>
{sections}
<script type="application/json" id="kvledger-sweep">{script_json(json.dumps(sweep, separators=(",", ":")))}</script>
<script>{DRAW}</script>
</body>
</html>
"""


CAPACITY_AXIS = {"title": {"text": "host capacity (slots)"}, "type": "log", "automargin": True}


def _layout(title: str) -> dict:
    return {"title": {"text": title, "x": 0, "xanchor": "left"}, "height": HEIGHT,
            "margin": {"l": MARGIN_LEFT, "r": MARGIN_RIGHT, "t": 92, "b": 60},
            "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
            "hovermode": "x unified"}


def _bytes_text(slots: int, slot_bytes: int) -> str:
    return f"{slots} slots = {slots * slot_bytes:,} bytes" if slot_bytes else f"{slots} slots"


def _hits_figure(sweep: dict) -> dict:
    points = sweep["points"]
    recorded = sweep["recorded"]
    slots = [row["num_tier_slots"] for row in points]
    hover = [_bytes_text(s, recorded["slot_bytes"]) for s in slots]
    data: list[dict] = []
    for policy, color in POLICY_COLORS.items():
        data.append({"type": "scatter", "mode": "lines+markers", "name": f"predicted, {policy.upper()}",
                     "x": slots, "y": [row["by_policy"][policy]["hit_tokens"] for row in points],
                     "line": {"color": color}, "text": hover,
                     "hovertemplate": "%{text}: %{y} hit tokens"})
    if any("lru_one_pass" in row for row in points):
        data.append({"type": "scatter", "mode": "lines", "name": "LRU, one-pass estimate",
                     "x": slots, "y": [row.get("lru_one_pass") for row in points],
                     "line": {"color": POLICY_COLORS["lru"], "dash": "dot"}})
    data.append({"type": "scatter", "mode": "markers", "name": f"recorded ({recorded['policy'].upper()})",
                 "x": [recorded["num_tier_slots"]], "y": [recorded["hit_tokens"]],
                 "marker": {"symbol": "diamond", "size": 13, "color": "#d62728"}})
    layout = _layout("Hit tokens against host capacity")
    layout["xaxis"] = CAPACITY_AXIS
    layout["yaxis"] = {"title": {"text": "hit tokens"}, "rangemode": "tozero"}
    return {"data": data, "layout": layout}


def _moved_figure(sweep: dict) -> dict:
    points = sweep["points"]
    slot_bytes = sweep["recorded"]["slot_bytes"]
    slots = [row["num_tier_slots"] for row in points]
    kinds = sorted({kind for row in points for moved in row["by_policy"].values() for kind in moved["blocks_moved"]})
    data: list[dict] = []
    for policy, color in POLICY_COLORS.items():
        for kind in kinds:
            blocks = [row["by_policy"][policy]["blocks_moved"].get(kind, 0) for row in points]
            text = [f"{b:,} blocks" + (f" = {b * slot_bytes:,} bytes" if slot_bytes else "") for b in blocks]
            data.append({"type": "scatter", "mode": "lines+markers", "name": f"{kind}, {policy.upper()}",
                         "x": slots, "y": blocks, "text": text, "hovertemplate": "%{text}",
                         "line": {"color": color, "dash": MOVED_DASH.get(kind, "dash")}})
    layout = _layout("Blocks moved against host capacity")
    layout["xaxis"] = CAPACITY_AXIS
    layout["yaxis"] = {"title": {"text": "blocks"}, "rangemode": "tozero"}
    return {"data": data, "layout": layout}
