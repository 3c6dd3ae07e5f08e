"""What an event log holds, read by the kvledger build that imports it (run it through `run_with_tree.py`).

Usage: log_events.py count LOG
         one JSON line: the header's versions, records and events by kind, up to a tear if any
       log_events.py wait LOG KIND N TIMEOUT_S
         exit 0 once the log's whole steps hold at least N events of KIND, 1 at the timeout
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

from kvledger.adapters.cli.log_commands import Prefix
from kvledger.adapters.log_files import open_log
from kvledger.events.log_records import LogError


def read(path: Path) -> tuple[object, Counter, int, str | None]:
    """(header, events by kind, records, the tear met or None)."""
    header, records = open_log(path)
    prefix = Prefix(records)  # a step cut by a crash is a tear: read up to it
    kinds: Counter = Counter()
    count = 0
    for record in prefix:
        count += 1
        event = getattr(record, "event", None)
        kinds[event.kind if event is not None else type(record).__name__] += 1
    return header, kinds, count, (str(prefix.tear) if prefix.tear else None)


def main() -> int:
    if sys.argv[1] == "count":
        header, kinds, count, tear = read(Path(sys.argv[2]))
        print(json.dumps({"schema_version": header.schema_version, "engine_version": header.engine_version,
                          "digest_interval": header.digest_interval, "records": count,
                          "events": sum(n for k, n in kinds.items() if k != "DigestRecord"),
                          "kinds": dict(sorted(kinds.items())), "tear": tear}))
        return 0
    if sys.argv[1] == "wait":
        path, kind, want, timeout = Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                _, kinds, _, _ = read(path) if path.exists() else (None, Counter(), 0, None)
            except LogError:  # not even the header yet
                kinds = Counter()
            if kinds[kind] >= want:
                print(json.dumps({"kinds": dict(sorted(kinds.items()))}), flush=True)
                return 0
            time.sleep(0.05)
        return 1
    raise SystemExit(__doc__)


if __name__ == "__main__":
    sys.exit(main())
