"""The HTML report of a replay: its series add up to the replay's own totals, and the page carries them."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kvledger.adapters.cli import report
from kvledger.adapters.cli.log_commands import summary
from kvledger.adapters.cli.main import main
from kvledger.adapters.log_files import open_log
from kvledger.adapters.log_tools import report_series
from kvledger.engine.replay import replay
from kvledger.events.log_records import EventRecord

pytestmark = pytest.mark.fast

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
LOGS = {
    "vllm_load_failures": GOLDEN / "vllm" / "load_failures_tiny-gemma3.jsonl.gz",
    "vllm_lazy_pressure": GOLDEN / "vllm" / "lazy_pressure_tiny-gemma3.jsonl.gz",
    "hybrid_failures_reset": GOLDEN / "hybrid_failures_reset.jsonl",  # store and load failures, resets, aborts
    "full_flush": GOLDEN / "full_flush.jsonl",
}
FIGURES = ("occupancy", "hits", "transfers", "incidents", "requests", "misses")
VOID = {"meta", "link", "br", "hr", "img", "input", "area", "base", "col", "embed", "source", "track", "wbr"}


def _replayed(path: Path) -> tuple[dict, dict, list]:
    """The series, and (independently, from a plain replay) the CLI's summary and the records."""
    header, records = open_log(path)
    records = list(records)
    _, series = report_series.collect(header.config, records)
    plain = summary(header, replay(header.config, records))
    return series, plain, records


class _Page(HTMLParser):
    """Checks that every element closes in order, and collects scripts, ids and links."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[str] = []
        self.errors: list[str] = []
        self.doctype = ""
        self.seen: list[str] = []
        self.scripts: list[tuple[dict, str]] = []
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.texts: list[str] = []
        self._script: dict | None = None

    def handle_decl(self, decl: str) -> None:
        self.doctype = decl

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attributes = dict(attrs)
        self.seen.append(tag)
        if "id" in attributes:
            self.ids.add(attributes["id"])
        self.links += [attributes[a] for a in ("src", "href") if a in attributes]
        if tag == "script":
            self._script = attributes
            self.scripts.append((attributes, ""))
        if tag not in VOID:
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.open or self.open[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.open[-1] if self.open else 'nothing'}")
            return
        self.open.pop()
        if tag == "script":
            self._script = None

    def handle_data(self, data: str) -> None:
        if self._script is not None:
            attributes, text = self.scripts[-1]
            self.scripts[-1] = (attributes, text + data)
        else:
            self.texts.append(data)


def _parse(page: str) -> _Page:
    parser = _Page()
    parser.feed(page)
    parser.close()
    assert not parser.errors, parser.errors[:5]
    assert not parser.open, f"unclosed: {parser.open}"
    assert parser.doctype.lower() == "doctype html"
    assert parser.seen[:3] == ["html", "head", "meta"] and "body" in parser.seen and "title" in parser.seen
    return parser


def _figure(parser: _Page, name: str) -> dict:
    (text,) = [t for a, t in parser.scripts if a.get("id") == f"figure-{name}"]
    return json.loads(text)


def _trace(figure: dict, prefix: str) -> dict:
    (trace,) = [t for t in figure["data"] if t["name"].startswith(prefix)]
    return trace


@pytest.mark.parametrize("name", sorted(LOGS))
def test_series_add_up_to_the_replay_totals(name: str) -> None:
    series, plain, records = _replayed(LOGS[name])
    stats, events = plain["stats"], [r for r in records if isinstance(r, EventRecord)]
    assert series["steps"] == sorted({r.step_index for r in events})
    n = len(series["steps"])
    for column in ("used_slots", "hit_tokens", "prompt_tokens_computed", "tokens_computed", "store_blocks",
                   "load_blocks", "store_failures", "load_failures", "flushes", "violations", "cache_resets"):
        assert len(series[column]) == n, column
    assert sum(series["hit_tokens"]) == stats["hit_tokens"]
    assert series["used_slots"][-1] == plain["tier"]["used_slots"]
    assert max(series["used_slots"]) <= plain["tier"]["capacity_slots"] == series["capacity_slots"]
    assert sum(series["store_failures"]) == stats["store_failures"]
    assert sum(series["load_failures"]) == stats["load_failures"]
    assert sum(series["flushes"]) == stats["flushes"]
    assert sum(series["load_blocks"]) == stats["keys_loaded"]
    assert sum(series["store_blocks"]) >= stats["keys_stored"] > 0  # every stored block was started
    assert sum(series["violations"]) == plain["violations"] == 0
    assert sum(series["cache_resets"]) == plain["events_by_kind"].get("cache_reset", 0)
    scheduled = [r.event for r in events if r.event.kind == "step_scheduled"]
    assert sum(series["tokens_computed"]) == sum(sum(e.num_scheduled_tokens) for e in scheduled)
    assert 0 < sum(series["prompt_tokens_computed"]) <= sum(series["tokens_computed"])

    requests = series["requests"]
    assert requests["total"] == plain["events_by_kind"]["request_added"] == len(requests["timelines"])
    ends = [t["end"] for t in requests["timelines"]]
    assert ends.count("finished") == stats["finished"] and ends.count("aborted") == stats["aborted"]
    assert ends.count(None) == plain["requests_live"]
    preempted = sum(1 for t in requests["timelines"] for s in t["segments"] if s["status"] == "preempted")
    assert preempted == stats["preemptions"]
    seqs = dict(zip(series["steps"], series["seq_ranges"]))
    for timeline in requests["timelines"]:
        segments = timeline["segments"]
        assert segments and segments[0]["status"] == "waiting"
        for segment in segments:  # each change happened in the step it is filed under
            first, last = seqs[segment["start"]]
            assert first <= segment["start_seq"] <= last
        for segment, following in zip(segments, segments[1:]):
            assert segment["start"] <= segment["end"] == following["start"]
            assert segment["start_seq"] <= segment["end_seq"] == following["start_seq"]
        if timeline["end"] is None:  # still live: its state lasts past the log
            assert (segments[-1]["end"], segments[-1]["end_seq"]) == (series["steps"][-1] + 1, None)
        else:
            assert (segments[-1]["end"], segments[-1]["end_seq"]) == (timeline["end_step"], timeline["end_seq"])
            assert segments[-1]["start_seq"] <= timeline["end_seq"]
    if stats["load_failures"]:  # a failed load leaves loading for waiting (several groups) or running
        loaded = [t for t in requests["timelines"] if any(s["status"] == "loading" for s in t["segments"])]
        assert len(loaded) == sum(1 for r in events if r.event.kind == "blocks_allocated"
                                  and r.event.num_external_tokens > 0)


def test_occupancy_is_the_tier_at_the_end_of_each_step() -> None:
    header, records = open_log(LOGS["hybrid_failures_reset"])
    records = list(records)
    series = report_series.collect(header.config, records)[1]
    assert len(set(series["used_slots"])) > 5
    for column in range(len(series["steps"])):
        last_seq = series["seq_ranges"][column][1]
        state = replay(header.config, records, until_seq=last_seq).state
        assert series["used_slots"][column] == state.core.num_used_slots(), series["steps"][column]


@pytest.mark.parametrize("name", ["vllm_load_failures", "hybrid_failures_reset"])
def test_page_is_html_and_embeds_the_series(name: str) -> None:
    series, plain, _ = _replayed(LOGS[name])
    page = report.render_html(series, source=str(LOGS[name]))
    parser = _parse(page)
    assert parser.links == []  # nothing fetched: the page works offline
    plotly_js = [t for a, t in parser.scripts if not a and "Plotly" in t and len(t) > 1_000_000]
    assert len(plotly_js) == 1
    (embedded,) = [t for a, t in parser.scripts if a.get("id") == "kvledger-series"]
    assert json.loads(embedded) == json.loads(json.dumps(series))

    for figure_name in FIGURES:
        (target,) = [a["data-target"] for a, _ in parser.scripts if a.get("id") == f"figure-{figure_name}"]
        assert target in parser.ids
    stats = plain["stats"]
    occupancy = _trace(_figure(parser, "occupancy"), "used slots")
    assert occupancy["y"][-1] == plain["tier"]["used_slots"]
    assert occupancy["x"] == series["steps"]
    hits = _trace(_figure(parser, "hits"), "prompt tokens restored")
    assert hits["y"][-1] == stats["hit_tokens"] and sum(hits["customdata"]) == stats["hit_tokens"]
    transfers = _figure(parser, "transfers")
    assert "no byte sizes" in transfers["layout"]["yaxis"]["title"]["text"]
    # Why tokens were computed: the stacked bars add up to what `kvledger explain` counts.
    misses = _figure(parser, "misses")
    assert sum(sum(t["y"]) for t in misses["data"]) == series["misses"]["totals"]["missed_tokens"] > 0
    assert {t["name"].split(" ")[0] for t in misses["data"]} == set(series["misses"]["totals"]["missed_by_cause"])
    assert sum(_trace(transfers, "loaded")["y"]) == stats["keys_loaded"]
    incidents = _figure(parser, "incidents")
    failures = [_trace(incidents, "store failures"), _trace(incidents, "load failures")]
    assert sum(sum(t["customdata"]) for t in failures) == stats["store_failures"] + stats["load_failures"] > 0
    assert all(c > 0 for t in failures for c in t["customdata"])  # a point only where something happened
    assert sum(_trace(incidents, "flushes")["customdata"]) == stats["flushes"]
    requests = _figure(parser, "requests")
    drawn = {rid for trace in requests["data"] if trace["type"] == "bar" for rid in trace["y"]}
    assert len(drawn) == plain["events_by_kind"]["request_added"]
    finished = _trace(requests, "finished")
    assert len(finished["y"]) == stats["finished"]
    text = " ".join(parser.texts)
    assert f"All {len(drawn)} requests" in text and "Replay result: ok." in text


def test_request_timelines_are_capped_and_the_page_says_so() -> None:
    header, records = open_log(LOGS["vllm_lazy_pressure"])
    _, series = report_series.collect(header.config, records, max_requests=5)
    requests = series["requests"]
    assert len(requests["timelines"]) == 5 and requests["total"] == 64
    assert [t["request_id"] for t in requests["timelines"]] == [
        t["request_id"] for t in _replayed(LOGS["vllm_lazy_pressure"])[0]["requests"]["timelines"][:5]]
    parser = _parse(report.render_html(series, source="log"))
    assert "Showing the first 5 of 64 requests" in " ".join(parser.texts)
    drawn = {rid for trace in _figure(parser, "requests")["data"] for rid in trace["y"]}
    assert len(drawn) == 5


def test_long_logs_are_bucketed_without_changing_the_totals() -> None:
    series, plain, _ = _replayed(LOGS["vllm_lazy_pressure"])
    shown, k = report.bucketed(series, max_points=25)
    assert k == 9 and len(shown["steps"]) <= 25
    for column in ("hit_tokens", "tokens_computed", "store_blocks", "load_blocks", "flushes", "store_failures"):
        assert sum(shown[column]) == sum(series[column]), column
    assert shown["used_slots"][-1] == plain["tier"]["used_slots"]
    parser = _parse(report.render_html(series, source="log", max_points=25))
    assert "buckets of 9 steps" in " ".join(parser.texts)
    assert len(_trace(_figure(parser, "occupancy"), "used slots")["x"]) == len(shown["steps"])
    assert report.bucketed(series)[1] == 1


def _recorded(tmp_path: Path, request_id: str, *, violate: bool) -> Path:
    from kvledger.adapters.engine_host import EngineHost
    from kvledger.events import types as ev
    from kvledger.events.config import EngineConfig, GroupSpec

    config = EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=16),), hash_block_size=16,
                          num_device_blocks=8, num_tier_slots=8)
    path = tmp_path / "small.jsonl"
    with EngineHost(config, log_path=path, fmt="jsonl") as host:
        host.apply(ev.RequestAdded(request_id=request_id, num_prompt_tokens=32, block_hashes=[b"x" * 16] * 2))
        host.apply(ev.BlocksAllocated(request_id=request_id, block_ids=((1, 2),)))
        if violate:
            host.apply(ev.BlocksAllocated(request_id="unknown", block_ids=((3,),)))
        host.apply(ev.StepScheduled(step_index=0, request_ids=[request_id], num_computed_tokens=[0],
                                        num_scheduled_tokens=[32]))
    return path


def test_violations_are_plotted_and_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log, out = _recorded(tmp_path, "a", violate=True), tmp_path / "report.html"
    assert main(["replay", str(log), "--report", str(out)]) == 1  # the report is written all the same
    capsys.readouterr()
    parser = _parse(out.read_text())
    (embedded,) = [t for a, t in parser.scripts if a.get("id") == "kvledger-series"]
    series = json.loads(embedded)
    assert series["violations"] == [1] and series["replay"]["first_problem"]["seq"] == 2
    assert _trace(_figure(parser, "incidents"), "violations")["customdata"] == [1]
    assert "First problem at seq 2 (violation)" in " ".join(parser.texts)
    assert series["prompt_tokens_computed"] == series["tokens_computed"] == [32]


def test_request_ids_cannot_break_out_of_the_page(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rid = "</script><script>alert(1)</script>&"
    log, out = _recorded(tmp_path, rid, violate=False), tmp_path / "report.html"
    assert main(["replay", str(log), "--report", str(out)]) == 0
    capsys.readouterr()
    page = out.read_text()
    assert "alert(1)</script>" not in page
    parser = _parse(page)
    (embedded,) = [t for a, t in parser.scripts if a.get("id") == "kvledger-series"]
    assert [t["request_id"] for t in json.loads(embedded)["requests"]["timelines"]] == [rid]


def test_cli_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "report.html"
    out.write_text("an older report")  # replaced with --force only
    log = str(LOGS["hybrid_failures_reset"])
    assert main(["replay", log, "--check", "--report", str(out)]) == 2
    assert out.read_text() == "an older report" and "exists; --force replaces it" in capsys.readouterr().err
    assert main(["replay", log, "--check", "--report", str(out), "--force"]) == 0
    printed = capsys.readouterr().out
    assert "result      ok" in printed and f"report      {out} (" in printed
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temporary file left behind

    assert main(["replay", log, "--json", "--report", str(out), "--force"]) == 0
    data = json.loads(capsys.readouterr().out)  # the JSON output stays JSON
    assert data["report"] == {"path": str(out), "bytes": out.stat().st_size}
    _parse(out.read_text())


def test_cli_report_until_stops_the_plots_there(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "report.html"
    assert main(["replay", str(LOGS["hybrid_failures_reset"]), "--until", "99", "--report", str(out)]) == 0
    capsys.readouterr()
    parser = _parse(out.read_text())
    (embedded,) = [t for a, t in parser.scripts if a.get("id") == "kvledger-series"]
    series = json.loads(embedded)
    assert series["seq_ranges"][-1][1] == 99 and series["replay"]["events"] == 100


@pytest.mark.parametrize("where", ["missing_folder", "folder", "empty"])
def test_cli_bad_report_path_exits_2(tmp_path: Path, where: str, capsys: pytest.CaptureFixture) -> None:
    path = {"missing_folder": str(tmp_path / "nope" / "report.html"), "folder": str(tmp_path), "empty": ""}[where]
    assert main(["replay", str(LOGS["full_flush"]), "--report", path]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("kvledger replay: ") and "Traceback" not in captured.err
    assert captured.out == ""  # refused before the replay
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_tier_below_host_memory_gets_its_row_and_panel(tmp_path: Path) -> None:
    import random

    from kvledger.adapters.engine_host import EngineHost
    from kvledger.adapters.testing.simulator import Simulator, run_random
    from tests.engine.builders import SIMULATED_CONFIGS

    config = next(c for c in SIMULATED_CONFIGS if c.lower_tiers and len(c.groups) == 1)
    path = tmp_path / "tiered.jsonl"
    with EngineHost(config, log_path=path, fmt="jsonl") as host:
        run_random(Simulator(config, host=host), random.Random(3), steps=150, arrivals=0.9, max_tokens=10,
                   completion_rate=0.4, fail_rate=0.1, damage_rate=0.1, foreign_rate=0.05)
    series, plain, _ = _replayed(path)
    (tier,) = series["lower_tiers"]
    (expected,) = plain["lower_tiers"]
    assert tier["name"] == expected["name"] == "1:fs" and len(tier["held"]) == len(series["steps"])
    assert tier["held"][-1] == expected["held_keys"]
    for name in ("keys_written", "keys_read", "write_failures", "read_failures", "keys_found", "evictions"):
        assert sum(tier[name]) == expected[name], name
    assert expected["keys_read"] > 0 and expected["keys_written"] > 0
    shown, k = report.bucketed(series, max_points=20)
    assert sum(shown["lower_tiers"][0]["keys_read"]) == expected["keys_read"] and k > 1
    parser = _parse(report.render_html(series, source="log", max_points=20))
    figure = _figure(parser, "tier-1")
    assert _trace(figure, "promoted")["y"] and "Tier 1:fs" in figure["layout"]["title"]["text"]
    assert any(f"{expected['keys_read']} promoted" in text for text in parser.texts)


def _with_a_reset(tmp_path: Path) -> Path:
    """A short simulated run (the hybrid scenario) with a cache reset half-way: 80 steps, like a demo's."""
    import random

    from kvledger.adapters.cli.log_commands import SCENARIOS
    from kvledger.adapters.engine_host import EngineHost
    from kvledger.adapters.testing.simulator import Simulator, run_random
    from kvledger.events.config import EngineConfig

    config = EngineConfig.from_dict({"store_jobs": "step", **SCENARIOS["hybrid"]})
    path, rng = tmp_path / "reset.jsonl", random.Random(5)
    with EngineHost(config, log_path=path, fmt="jsonl", strict=True) as host:
        sim = Simulator(config, host=host)
        run_random(sim, rng, steps=40, arrivals=0.9, max_tokens=30, completion_rate=0.3, fail_rate=0.0)
        sim.reset()
        run_random(sim, rng, steps=40, arrivals=0.9, max_tokens=30, completion_rate=0.3, fail_rate=0.0)
    return path


def _step_figures(parser: _Page) -> dict[str, dict]:
    """Every figure drawn over the steps, by name."""
    return {a["id"].removeprefix("figure-"): json.loads(t) for a, t in parser.scripts
            if a.get("class") == "kvledger-figure"}


def _reset_lines(figure: dict) -> list[dict]:
    return [s for s in figure["layout"].get("shapes", ()) if s.get("legendgroup") == "cache resets"]


@pytest.mark.parametrize("name", ["reset", "vllm_load_failures", "hybrid_failures_reset"])
def test_resets_are_marked_on_every_step_plot(tmp_path: Path, name: str) -> None:
    path = _with_a_reset(tmp_path) if name == "reset" else LOGS[name]
    series, plain, records = _replayed(path)
    resets = [(r.step_index, r.seq) for r in records
              if isinstance(r, EventRecord) and r.event.kind == "cache_reset"]
    assert resets and series["resets"] == [list(r) for r in resets]
    assert len(series["resets"]) == sum(series["cache_resets"]) == plain["events_by_kind"]["cache_reset"]
    parser = _parse(report.render_html(series, source="log"))
    figures = _step_figures(parser)
    assert set(FIGURES) <= set(figures)
    for figure_name, figure in figures.items():
        lines = _reset_lines(figure)
        assert len(lines) == len(resets), figure_name
        for line, (step, _) in zip(lines, resets):  # in its step's column, top to bottom of the plot
            assert line["type"] == "line" and line["x0"] == line["x1"], figure_name
            assert step - 0.5 <= line["x0"] < step + 0.5, figure_name
            assert (line["yref"], line["y0"], line["y1"]) == ("paper", 0, 1)
        assert sum(line.get("showlegend", False) for line in lines) == (figure_name != "incidents")
        labels = [a["text"] for a in figure["layout"].get("annotations", ())]
        assert f"reset, step {resets[0][0]}" in labels, figure_name
    count = len(resets)
    assert f"mark the {count} cache reset{'s' if count > 1 else ''}" in " ".join(parser.texts)


def test_no_reset_no_lines() -> None:
    series, _, _ = _replayed(LOGS["full_flush"])
    assert series["resets"] == []
    parser = _parse(report.render_html(series, source="log"))
    assert all(not _reset_lines(figure) for figure in _step_figures(parser).values())
    assert "cache reset" not in " ".join(parser.texts)


@pytest.mark.parametrize("name", ["reset", "vllm_load_failures", "hybrid_failures_reset", "full_flush"])
def test_every_step_plot_spans_the_whole_run(tmp_path: Path, name: str) -> None:
    path = _with_a_reset(tmp_path) if name == "reset" else LOGS[name]
    series, _, _ = _replayed(path)
    parser = _parse(report.render_html(series, source="log"))
    whole = [series["steps"][0] - 0.5, series["steps"][-1] + 0.5]
    for figure_name, figure in _step_figures(parser).items():  # the requests' too: all are drawn
        assert figure["layout"]["xaxis"]["range"] == whole, figure_name
    incidents = _figure(parser, "incidents")
    assert incidents["layout"]["yaxis"]["range"] == [-0.5, len(report.INCIDENTS) - 0.5]  # every row
    if name == "reset":  # every mark at the reset's step: the panel still spans the run
        assert {x for trace in incidents["data"] for x in trace["x"]} == {series["resets"][0][0]}


def test_capped_request_timelines_end_where_the_drawn_requests_do() -> None:
    header, records = open_log(LOGS["vllm_lazy_pressure"])
    _, series = report_series.collect(header.config, records, max_requests=5)
    requests = _figure(_parse(report.render_html(series, source="log")), "requests")
    low, high = requests["layout"]["xaxis"]["range"]
    ends = [b + x for trace in requests["data"] if trace["type"] == "bar" for b, x in zip(trace["base"], trace["x"])]
    assert low == series["steps"][0] - 0.5 and max(ends) <= high < series["steps"][-1]
    assert requests["layout"]["yaxis"]["range"] == [4.5, -0.5]  # the first request on top, no padding


def _stretched(series: dict, steps: int) -> dict:
    """The series' per-step columns repeated over `steps` steps (a long run, for drawing only)."""
    n, last_seq = len(series["steps"]), series["seq_ranges"][-1][1]
    assert series["steps"] == list(range(n))
    out = dict(series, steps=list(range(steps)), resets=[[4003, last_seq + 1 + 10 * (4003 - n)]])
    out["seq_ranges"] = series["seq_ranges"] + [[last_seq + 1 + 10 * i, last_seq + 10 + 10 * i]
                                                for i in range(steps - n)]
    for name in ("used_slots", "hit_tokens", "prompt_tokens_computed", "tokens_computed", "store_blocks",
                 "load_blocks", "keys_failed", *(name for name, _, _ in report.INCIDENTS)):
        out[name] = [series[name][i % n] for i in range(steps)]
    out["misses"] = dict(series["misses"], by_cause={cause: [tokens[i % n] for i in range(steps)]
                                                     for cause, tokens in series["misses"]["by_cause"].items()})
    return out


def test_blocks_moved_stays_readable_at_any_length() -> None:
    series, _, _ = _replayed(LOGS["hybrid_failures_reset"])
    assert len(series["steps"]) == 60
    short = _figure(_parse(report.render_html(series, source="log")), "transfers")
    for trace in short["data"]:  # a short run: one bar a step
        assert trace["x"] == series["steps"] and trace["y"] == series[
            {"stored": "store_blocks", "loaded": "load_blocks", "failed": "keys_failed"}[trace["name"].split()[0]]]
    assert short["layout"]["title"]["text"] == "Blocks moved per step"

    long = _stretched(series, 5000)
    parser = _parse(report.render_html(long, source="log"))
    transfers = _figure(parser, "transfers")
    assert transfers["layout"]["title"]["text"] == "Blocks moved per 50 steps"
    bars = [t for t in transfers["data"] if t["type"] == "bar"]
    assert len(bars) == 3 and sum(len(t["x"]) for t in bars) <= report.MAX_BARS
    plot_px = 1400 - transfers["layout"]["margin"]["l"] - transfers["layout"]["margin"]["r"]
    assert plot_px / sum(len(t["x"]) for t in bars) >= 3.5  # pixels a bar, gaps included: no hairlines
    for trace in bars:
        assert trace["x"][0] == 24.5 and all(b - a == 50 for a, b in zip(trace["x"], trace["x"][1:]))
        assert all(last - first == 49 for first, last in trace["customdata"])  # each bar covers 50 steps
        assert trace["customdata"][0] == [0, 49] and trace["customdata"][-1] == [4950, 4999]
    assert sum(_trace(transfers, "stored")["y"]) == sum(long["store_blocks"])
    assert sum(_trace(transfers, "failed")["y"]) == sum(long["keys_failed"])
    assert "each bar sums 50 steps" in transfers["layout"]["xaxis"]["title"]["text"]
    assert "Each bar sums 50 steps" in " ".join(parser.texts)
    for figure_name, figure in _step_figures(parser).items():
        if figure_name != "requests":  # those draw the first requests only
            assert figure["layout"]["xaxis"]["range"] == [-0.5, 4999.5], figure_name
            assert [line["x0"] for line in _reset_lines(figure)] == [4003 - 0.5], figure_name


def test_bar_bins_are_round_and_few() -> None:
    for steps, series, width in ((60, 3, 1), (100, 3, 1), (101, 3, 2), (144, 3, 2), (5000, 3, 50),
                                 (5001, 3, 100), (100, 6, 2), (5000, 6, 100), (1_000_000, 3, 10_000)):
        assert report.bar_bin(list(range(steps)), series) == width, (steps, series)
        assert steps * series / width <= report.MAX_BARS
    centres, spans, sums = report.binned([3, 4, 5, 9, 12], 5, {"a": [1, 2, 3, 4, 5]})
    assert centres == [5.0, 10.0] and spans == [[3, 7], [8, 12]] and sums == {"a": [6, 9]}


def test_legends_sit_under_the_titles_and_above_the_plots() -> None:
    series, _, _ = _replayed(LOGS["hybrid_failures_reset"])
    for name, page_series in (("short", series), ("long", _stretched(series, 5000))):
        for figure_name, figure in _step_figures(_parse(report.render_html(page_series, source="log"))).items():
            layout, where = figure["layout"], f"{name} {figure_name}"
            height, title, legend = layout["height"], layout["title"], layout["legend"]
            assert (title["yref"], title["y"], title["yanchor"]) == ("container", 1, "top"), where
            title_bottom = title["pad"]["t"] + 22  # the template's 17 px title font, and its line
            assert (legend["yref"], legend["yanchor"], legend["orientation"]) == ("container", "top", "h"), where
            legend_top = round((1 - legend["y"]) * height)
            assert title_bottom <= legend_top, where  # the legend starts under the title...
            assert legend_top + 40 <= layout["margin"]["t"], where  # ...with room for two rows above the plot
            assert layout["showlegend"] is True, where
