"""Record a build's stored blocks: a block file and a Valkey value of one block,
plain, under a secret's MAC and encrypted, for every later build to read
(`tests/test_compat_blocks.py`). Files here are only ever added, never
recorded again.

    python tests/compat/run_with_tree.py TREE tests/compat/record_blocks.py --build COMMIT \\
        --out tests/compat/blocks/COMMIT
(or, for the checkout itself, `.venv/bin/python tests/compat/record_blocks.py ...`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from kvledger.transfers.lower_tiers.block_seal import BlockSeal

try:
    from kvledger.transfers.lower_tiers.fs.block_file import write_block
    from kvledger.transfers.lower_tiers.valkey.block_value import encode_value
except ImportError:  # a build before each tier type was a package (325822e and earlier)
    from kvledger.transfers.lower_tiers.block_file import write_block  # type: ignore[no-redef]
    from kvledger.transfers.lower_tiers.block_value import encode_value  # type: ignore[no-redef]

SECRET = bytes(range(100, 132))  # 32 bytes, as a hex or base64 secret decodes
NAMESPACE = bytes(range(16))
KEY = bytes(range(32, 64))
PAYLOAD_BYTES = 1000


def payload() -> bytes:
    return (bytes(range(256)) * 4)[:PAYLOAD_BYTES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists: a build's blocks are recorded once")
    args.out.mkdir(parents=True)
    cases = []
    for seal_name, seal in (("plain", None), ("mac", BlockSeal(SECRET)), ("encrypted", BlockSeal(SECRET, encrypt=True))):
        name = f"{seal_name}.kvb"
        write_block(args.out / name, NAMESPACE, KEY, bytearray(payload()), seal)
        cases.append({"kind": "file", "seal": seal_name, "file": name})
        name = f"{seal_name}.value"
        (args.out / name).write_bytes(encode_value(NAMESPACE, KEY, bytearray(payload()), seal))
        cases.append({"kind": "value", "seal": seal_name, "file": name})
    version = subprocess.run([sys.executable, "-m", "kvledger.adapters.cli.main", "--version"],
                             capture_output=True, text=True).stdout.strip()
    (args.out / "meta.json").write_text(json.dumps({
        "build": args.build, "version": version, "secret_hex": SECRET.hex(), "namespace_hex": NAMESPACE.hex(),
        "key_hex": KEY.hex(), "payload": f"bytes(range(256)) repeated, the first {PAYLOAD_BYTES} bytes",
        "cases": cases}, indent=2) + "\n")
    print(f"recorded {len(cases)} blocks in {args.out}")


if __name__ == "__main__":
    main()
