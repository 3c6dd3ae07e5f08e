"""Screenshots of `kvledger replay --report` pages, to check them by eye.

Writes two logs and their reports into DIR, then a full-page PNG of each page
taken by headless Chromium at 1,400 px wide:

  long      `kvledger simulate --scenario hybrid --seed 1 --steps 5000`: a long run
  reset     about 100 simulated steps (the hybrid scenario, with a disk tier
            below host memory) with failures and one cache reset half-way,
            like the demo's short run

and the same for each LOG named on the command line (the demo's log, say:
`make demo` leaves it at bench/out/demo-events.log). A log already in DIR is
reused; delete it to write a fresh one.

    python bench/report_screenshots.py [--out DIR] [LOG ...]

Chromium: `chromium`, `chromium-browser` or `google-chrome` on the PATH
(Debian: `apt-get install chromium`). Open DIR/*.png and look for:

  - "Blocks moved": bars a few pixels wide at any length (at most 100 bars a
    series; at 5,000 steps each sums 50 steps), not hairlines;
  - every legend in its own band under its figure's title, never over it;
  - the step plots (occupancy, hits, blocks moved, flushes and failures, the
    tiers below host memory) spanning the same steps, first to last, so they
    line up one under another; "Flushes and failures" showing all its rows
    and the whole run even with a single mark;
  - each cache reset a dashed brown line, labelled "reset, step N", on every
    step plot (and on the requests' timelines);
  - "Why prompt tokens were computed, not restored": stacked bars of computed
    tokens by cause (`kvledger explain`'s), summed per window as "Blocks
    moved" is, each cause's total in its legend entry;
  - reset-sweep.png, `whatif --sweep --report` of the reset run: hit tokens
    against host capacity under LRU and ARC with the recorded point (a red
    diamond) on the asked policy's curve, and blocks stored, loaded and written
    to the disk tier at each capacity.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WIDTH = 1400
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def long_log(path: Path) -> None:
    from kvledger.adapters.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()):
        status = main(["simulate", "--scenario", "hybrid", "--seed", "1", "--steps", "5000", "--out", str(path)])
    if status:
        raise SystemExit(f"simulate exited {status}")


def reset_log(path: Path) -> None:
    """About 100 steps of the hybrid scenario with a disk tier below host memory, with failures,
    and one cache reset after step 50."""
    from kvledger.adapters.cli.log_commands import SCENARIOS
    from kvledger.adapters.engine_host import EngineHost
    from kvledger.adapters.testing.simulator import Simulator, run_random
    from kvledger.events.config import EngineConfig

    config = EngineConfig.from_dict({"store_jobs": "step", **SCENARIOS["hybrid"], "num_tier_slots": 16,
                                     "lower_tiers": [{"name": "1:fs", "num_blocks": 40}]})
    rng = random.Random(7)
    with EngineHost(config, log_path=path, fmt="jsonl", strict=True) as host:
        sim = Simulator(config, host=host)
        run_random(sim, rng, steps=50, arrivals=0.9, max_tokens=30, completion_rate=0.3, fail_rate=0.05)
        sim.reset()
        run_random(sim, rng, steps=50, arrivals=0.9, max_tokens=30, completion_rate=0.3, fail_rate=0.05)


def report(log: Path, page: Path) -> None:
    from kvledger.adapters.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()) as out:
        status = main(["replay", str(log), "--report", str(page), "--force"])
    if status:
        raise SystemExit(f"replay {log} exited {status}:\n{out.getvalue()}")


def sweep_report(log: Path, page: Path) -> None:
    from kvledger.adapters.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()) as out:
        status = main(["whatif", str(log), "--sweep", "--report", str(page), "--force"])
    if status:
        raise SystemExit(f"whatif {log} exited {status}:\n{out.getvalue()}")


def page_height(page: Path) -> int:
    """The page's height, near enough: its figures' heights, their notes, and the summary above them."""
    text = page.read_text()
    figures = re.findall(r'<script type="application/json" class="kvledger-figure"[^>]*>(.*?)</script>', text, re.S)
    return 560 + sum(json.loads(f)["layout"]["height"] + 90 for f in figures)


def screenshot(browser: str, page: Path, png: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="kvledger-chromium-") as profile:
        done = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={profile}",
             f"--window-size={WIDTH},{page_height(page)}", "--virtual-time-budget=20000",
             f"--screenshot={png}", page.resolve().as_uri()],
            capture_output=True, text=True, timeout=180)
    if done.returncode or not png.exists():
        raise SystemExit(f"{browser} failed on {page}:\n{done.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/report-screenshots"))
    parser.add_argument("logs", nargs="*", type=Path, help="more logs to render and photograph")
    args = parser.parse_args(argv)
    browser = next((b for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        raise SystemExit("no Chromium on the PATH (Debian: apt-get install chromium)")
    args.out.mkdir(parents=True, exist_ok=True)
    logs = {"long": args.out / "long.log", "reset": args.out / "reset.jsonl"}
    for name, write in (("long", long_log), ("reset", reset_log)):
        if not logs[name].exists():
            print(f"writing {logs[name]}", flush=True)
            write(logs[name])
    for extra in args.logs:
        logs[extra.name.split(".")[0]] = extra
    for name, log in logs.items():
        page, png = args.out / f"{name}.html", args.out / f"{name}.png"
        report(log, page)
        screenshot(browser, page, png)
        print(f"{png}  ({log})", flush=True)
    # The sweep's page (`whatif --sweep --report`), of the run with a reset and a disk tier.
    page, png = args.out / "reset-sweep.html", args.out / "reset-sweep.png"
    sweep_report(logs["reset"], page)
    screenshot(browser, page, png)
    print(f"{png}  (whatif --sweep of {logs['reset']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
