"""Every build reads the blocks earlier builds stored (`tests/compat/blocks/<build>/`,
made by `tests/compat/record_blocks.py` with that build): a block file and a
Valkey value, plain, under a secret's MAC and encrypted, each served whole by
this build with the secret it was written under, and refused without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.transfers.lower_tiers.block_errors import BlockFileError
from kvledger.transfers.lower_tiers.block_seal import BlockSeal
from kvledger.transfers.lower_tiers.fs.block_file import read_block_into
from kvledger.transfers.lower_tiers.valkey.block_value import decode_value_into

pytestmark = pytest.mark.fast

HERE = Path(__file__).parent / "compat" / "blocks"
CASES = [(folder, case) for folder in sorted(HERE.iterdir())
         for case in json.loads((folder / "meta.json").read_text())["cases"]]


def read(folder: Path, case: dict, seal: BlockSeal | None) -> bytes:
    meta = json.loads((folder / "meta.json").read_text())
    namespace, key = bytes.fromhex(meta["namespace_hex"]), bytes.fromhex(meta["key_hex"])
    out = bytearray(1000)
    path = folder / case["file"]
    if case["kind"] == "file":
        read_block_into(path, namespace, key, out, seal)
    else:
        decode_value_into(path.read_bytes(), namespace, key, out, seal, str(path))
    return bytes(out)


def test_there_are_recorded_blocks_of_each_kind() -> None:
    assert {(c["kind"], c["seal"]) for _, c in CASES} == {
        (kind, seal) for kind in ("file", "value") for seal in ("plain", "mac", "encrypted")}
    assert len({folder for folder, _ in CASES}) >= 2


@pytest.mark.parametrize("folder, case", CASES, ids=[f"{f.name}-{c['kind']}-{c['seal']}" for f, c in CASES])
def test_a_recorded_block_is_served_whole_with_its_secret_and_refused_without(folder, case) -> None:
    secret = bytes.fromhex(json.loads((folder / "meta.json").read_text())["secret_hex"])
    expected = (bytes(range(256)) * 4)[:1000]
    if case["seal"] == "plain":
        assert read(folder, case, None) == expected
        with pytest.raises(BlockFileError) as refused:
            read(folder, case, BlockSeal(secret))
        assert refused.value.reason == "forged"  # a tier with a secret takes only sealed blocks
        return
    assert read(folder, case, BlockSeal(secret, encrypt=case["seal"] == "encrypted")) == expected
    assert read(folder, case, BlockSeal(secret, encrypt=case["seal"] != "encrypted")) == expected  # either reads
    with pytest.raises(BlockFileError) as refused:
        read(folder, case, BlockSeal(bytes(32)))
    assert refused.value.reason == "foreign"  # another secret's key id
    with pytest.raises(BlockFileError):
        read(folder, case, None)
