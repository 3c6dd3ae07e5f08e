"""`kvledger whatif LOG1 LOG2 --shared-tier` against a real shared Valkey tier.

Two replicas of tiny-llama serve the same eight 300-word documents, each its own
questions (the first three of each document to one, the last three to the
other), batches of eight prompts, host memory for four documents. First they
run apart, host memory only, one after the other: their logs. From those logs
`whatif` predicts the hit tokens of each with one Valkey tier below both. Then
they run again, one after the other, with a real Valkey server (started here)
below both, and the hit tokens are measured.

    python bench/fleet_validation.py [--out bench/out/fleet]

With `--together`, the shared run serves both replicas at the same time (two
processes), over a Valkey tier of `--shared-docs` documents (3 by default),
small enough to evict, and the prediction takes the logs recorded apart as
replicas that started together (`whatif --together`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support's Valkey server
sys.path.insert(0, str(Path(__file__).resolve().parent))

from whatif_validation import WORKLOADS, _measured, _run, _slot_bytes  # noqa: E402

SHARED_BYTES = 256 << 20
REPLICAS = {"a": range(0, 3), "b": range(3, 6)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "fleet"))
    parser.add_argument("--together", action="store_true",
                        help="the shared run: both replicas at once, over a tier small enough to evict")
    parser.add_argument("--shared-docs", type=float, default=3.0, help="with --together: the tier's size, in documents")
    parser.add_argument("--lru-samples", type=int, default=5,
                        help="with --together: Valkey's maxmemory-samples (5, its default: an approximate LRU; the "
                        "prediction's tier is an exact one)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = out / "models"
    spec = WORKLOADS["multi"]

    probe = out / "probe.log"
    _run("multi", 1 << 30, probe, models, questions=range(0, 1))
    slot = _slot_bytes(probe)
    host = spec["record"] * (spec["doc_words"] // spec["block"]) * slot

    apart = {name: out / f"apart-{name}.log" for name in REPLICAS}
    for name, questions in REPLICAS.items():
        _run("multi", host, apart[name], models, questions=questions)

    from kvledger.adapters.cli.main import main as kvledger

    shared_bytes = int(args.shared_docs * (spec["doc_words"] // spec["block"]) * slot) if args.together \
        else SHARED_BYTES
    predicted_file = out / "predicted.json"
    with open(predicted_file, "w") as sink, contextlib.redirect_stdout(sink):
        status = kvledger(["whatif", *map(str, apart.values()), "--shared-tier",
                           json.dumps({"type": "valkey", "capacity_bytes": shared_bytes}), "--json",
                           *(["--together"] if args.together else [])])
    assert status == 0, status
    predicted = json.loads(predicted_file.read_text())

    from tests.support.valkey_servers import ServerProcess

    server = ServerProcess(maxmemory="512mb", policy="allkeys-lru")
    try:
        if args.together:
            # Valkey evicts by its own memory: its start-up use, a block's value as its allocator rounds
            # it (measured here), and room for the two replicas' connections. So it holds about the
            # tier's blocks when it evicts, as the prediction's tier does.
            server.cli("CONFIG", "SET", "maxmemory", str(_valkey_bytes(server, shared_bytes // slot, slot)))
            server.cli("CONFIG", "SET", "maxmemory-samples", str(args.lru_samples))
        tiers = [{"type": "valkey", "url": server.url, "capacity_bytes": shared_bytes, "timeout_s": 2.0}]
        shared = {name: out / f"shared-{name}.log" for name in REPLICAS}
        if args.together:  # two processes serving at once, each its own questions
            with ThreadPoolExecutor(len(REPLICAS)) as pool:
                for done in [pool.submit(_run, "multi", host, shared[name], models, questions=questions, tiers=tiers)
                             for name, questions in REPLICAS.items()]:
                    done.result()
        else:
            for name, questions in REPLICAS.items():
                _run("multi", host, shared[name], models, questions=questions, tiers=tiers)
        stats = dict(line.split(":", 1) for line in server.cli("INFO", "stats").splitlines() if ":" in line)
        evicted = int(stats.get("evicted_keys", "0"))
    finally:
        server.close()

    # Restored tokens, predicted and measured: hits that stuck (a load that fails is counted as a hit
    # by the engine when it starts, and recomputed; in the prediction, a promotion of a block the
    # other replica's writes evicted fails).
    print(f"{'replica':<8} {'apart':>7} {'predicted alone':>15} {'predicted shared':>16} {'measured restored':>17} "
          f"{'(engine hits)':>13} {'error':>7}")
    rows = []
    for (name, _), row in zip(REPLICAS.items(), predicted["replicas"]):
        restored = _restored(shared[name])
        error = (row["predicted_shared_restored_tokens"] - restored) / restored if restored else None
        rows.append({"replica": name, "apart": _measured(apart[name]),
                     "predicted_alone": row["predicted_alone_hit_tokens"],
                     "predicted_shared": row["predicted_shared_restored_tokens"], "measured_restored": restored,
                     "measured_hits": _measured(shared[name]), "error": None if error is None else round(error, 4)})
        print(json.dumps(rows[-1]), file=sys.stderr)
    total = {key: sum(r[key] for r in rows) for key in ("apart", "predicted_alone", "predicted_shared",
                                                        "measured_restored", "measured_hits")}
    total["error"] = round((total["predicted_shared"] - total["measured_restored"]) / total["measured_restored"], 4)
    for row in [*rows, {"replica": "both", **total}]:
        error = f"{row['error']:+.1%}" if row["error"] is not None else "-"
        print(f"{row['replica']:<8} {row['apart']:>7} {row['predicted_alone']:>15} {row['predicted_shared']:>16} "
              f"{row['measured_restored']:>17} {row['measured_hits']:>13} {error:>7}")
    print(f"shared tier: {predicted['shared_tier']}; Valkey evicted {evicted} keys")


def _valkey_bytes(server, blocks: int, slot: int) -> int:
    """The `maxmemory` at which this server holds `blocks` values of a block's size, and 1 MB for clients."""

    def used() -> int:
        info = dict(line.split(":", 1) for line in server.cli("INFO", "memory").splitlines() if ":" in line)
        return int(info["used_memory"])

    start = used()
    probe = 16
    for index in range(probe):
        server.cli("SET", f"maxmemory-probe-{index}", "x" * (slot + 64))
    per_block = (used() - start) // probe
    server.cli("DEL", *(f"maxmemory-probe-{index}" for index in range(probe)))
    return start + blocks * per_block + (1 << 20)


def _restored(log: Path) -> int:
    """`kvledger explain`'s restored tokens: hits whose load did not fail."""
    from kvledger.adapters.log_files import open_log
    from kvledger.adapters.log_tools import whatif

    header, records = open_log(log)
    return whatif.recorded(header.config, records).misses["restored_tokens"]


if __name__ == "__main__":
    main()
