"""Both lower tiers with a secret, on a real directory and a real valkey-server:
a block that whoever can write the directory or the store put there, without
the secret, fails its position as "forged" (counted apart), while blocks the
tier sealed round trip; a tier with another secret finds them foreign."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from kvledger.transfers.copies.backend import TransferTimeout
from kvledger.transfers.lower_tiers import block_header as bh
from kvledger.transfers.lower_tiers.block_seal import BlockSeal
from kvledger.transfers.lower_tiers.fs import block_file as bf
from kvledger.transfers.lower_tiers.fs.tier import FsTierIO
from kvledger.transfers.lower_tiers.tier_jobs import LowerTierJobs
from kvledger.transfers.lower_tiers.valkey.block_value import encode_value, store_key
from kvledger.transfers.lower_tiers.valkey.store import ValkeyServer, ValkeyStore
from kvledger.transfers.lower_tiers.valkey.tier import ValkeyTierIO

NS = bytes(range(16))
SIZES = (64 << 10, 5000)
SLOTS = 16
SECRET = b"the-fleet-secret-0123456789abcdef"
OTHER = b"another-fleet-secret-0123456789ab"


def key(n: int, group: int = 0) -> bytes:
    return bytes([group]) * 16 + n.to_bytes(16, "big")


@pytest.fixture
def rows() -> torch.Tensor:
    data = np.random.default_rng(0).integers(-128, 128, (SLOTS, max(SIZES)), dtype=np.int8)
    return torch.from_numpy(data)


@pytest.fixture
def made():
    ios: list = []
    yield ios
    for io in ios:
        with contextlib.suppress(TransferTimeout):
            io.shutdown(drain=False, timeout_s=10)


def fs_tier(made, root, rows, seal, direct_writes=True, pack_bytes=0) -> FsTierIO:
    """One file per block unless `pack_bytes`: these tests forge and damage a block's file."""
    made.append(FsTierIO(root=str(root), namespace=NS, rows=rows, payload_bytes=SIZES, threads=2,
                         direct_writes=direct_writes, seal=seal, pack_bytes=pack_bytes))
    return made[-1]


def valkey_tier(made, process, rows, seal) -> ValkeyTierIO:
    server = ValkeyServer(nodes=(("127.0.0.1", process.port),), timeout_s=1.0)
    made.append(ValkeyTierIO(server=server, name="1:valkey", namespace=NS, rows=rows, payload_bytes=SIZES,
                             connections=2, seal=seal))
    return made[-1]


def run(io, job_id: int, kind: str, keys, slots):
    getattr(io, kind)(job_id, keys, slots)
    io.wait([job_id], 30)
    (outcome,) = io.poll()
    return outcome


KEYS = ((key(1), key(2), key(3)), (key(1, 1), key(2, 1), key(3, 1)))
WRITE_SLOTS = ((0, 1, 2), (3, 4, 5))
READ_SLOTS = ((8, 9, 10), (11, 12, 13))


def same_rows(rows: torch.Tensor) -> bool:
    return all(torch.equal(rows[r, :SIZES[g]], rows[w, :SIZES[g]])
               for g in range(2) for w, r in zip(WRITE_SLOTS[g], READ_SLOTS[g]))


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "encrypted"])
@pytest.mark.parametrize("direct_writes", [True, False], ids=["direct", "buffered"])
def test_an_fs_tier_with_a_secret_serves_its_own_blocks_and_refuses_forged_ones(
        made, tmp_path, rows, encrypt, direct_writes) -> None:
    seal = BlockSeal(SECRET, encrypt=encrypt)
    io = fs_tier(made, tmp_path, rows, seal, direct_writes)
    assert run(io, 1, "write", KEYS, WRITE_SLOTS).ok
    assert run(io, 2, "read", KEYS, READ_SLOTS).ok and same_rows(rows)
    path = bf.block_path(tmp_path, NS, key(2))
    assert (path.read_bytes()[bh.HEADER_BYTES:] == rows[1, :SIZES[0]].numpy().tobytes()) is not encrypt

    # Whoever can write the directory rewrites a block with kvledger's own writer, no secret.
    bf.write_block(path, NS, key(2), np.full(SIZES[0], 5, np.int8))
    rows[8:14] = 7
    outcome = run(io, 3, "read", KEYS, READ_SLOTS)
    assert dict(zip(outcome.failed, outcome.reasons)) == {(0, 1): "forged"}
    # The refused block's bytes are not left in its host row (nor, encrypted, what decrypting it made).
    assert not rows[READ_SLOTS[0][1], :SIZES[0]].any()

    # A replica with another secret: every block foreign, none served.
    other = fs_tier(made, tmp_path, rows, BlockSeal(OTHER))
    outcome = run(other, 4, "read", KEYS, READ_SLOTS)
    assert set(outcome.reasons) == {"foreign", "forged"} and len(outcome.failed) == 6


def test_forged_blocks_are_counted_apart_in_the_tier_stats(made, tmp_path, rows) -> None:
    from kvledger.engine.effects import StartLoad

    io = fs_tier(made, tmp_path, rows, BlockSeal(SECRET))
    assert run(io, 1, "write", KEYS, WRITE_SLOTS).ok
    bf.write_block(bf.block_path(tmp_path, NS, key(3, 1)), NS, key(3, 1), np.zeros(SIZES[1], np.int8))
    jobs = LowerTierJobs({1: io}, SLOTS, 0)
    load = StartLoad(job_id=7, request_id="r", keys=KEYS, source_slot_ids=READ_SLOTS,
                     target_block_ids=((0, 1, 2), (0, 1, 2)), promote_tiers=((1, 1, 1), (1, 1, 1)))
    assert jobs.promote(load) is None
    io.wait([7], 30)
    for _ in range(100):
        _, promoted = jobs.poll()
        if promoted:
            break
    assert promoted == [(load, {(1, 2)}, "forged")]  # the read it failed, and why
    (stat,) = jobs.take_stats()
    assert (stat.forged, stat.unreachable, stat.ok) == (1, 0, False)


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "encrypted"])
def test_a_valkey_tier_with_a_secret_refuses_values_set_by_anyone_else(made, valkey_server, rows, encrypt) -> None:
    process = valkey_server()
    io = valkey_tier(made, process, rows, BlockSeal(SECRET, encrypt=encrypt))
    assert run(io, 1, "write", KEYS, WRITE_SLOTS).ok
    assert run(io, 2, "read", KEYS, READ_SLOTS).ok and same_rows(rows)
    # A plain SET of a well-formed, checksummed value under a name read from SCAN.
    store = ValkeyStore(ValkeyServer(nodes=(("127.0.0.1", process.port),)))
    try:
        names = {bytes(name) for name in store._connect().scan_iter(match=b"kvledger:*")}
        assert store_key(NS, key(1)) in names and len(names) == 6
        store._connect().set(store_key(NS, key(1)), encode_value(NS, key(1), np.ones(SIZES[0], np.int8)))
    finally:
        store.close()
    outcome = run(io, 3, "read", KEYS, READ_SLOTS)
    assert dict(zip(outcome.failed, outcome.reasons)) == {(0, 0): "forged"}
    assert not rows[READ_SLOTS[0][0], :SIZES[0]].any()  # the forged value's ones are not left in the row
    other = valkey_tier(made, process, rows, BlockSeal(OTHER))
    outcome = run(other, 4, "read", KEYS, READ_SLOTS)
    assert len(outcome.failed) == 6 and set(outcome.reasons) == {"foreign", "forged"}


def test_a_key_prefix_lets_an_acl_confine_a_deployment_to_its_keys(made, valkey_server, rows) -> None:
    """The README's ACL line, on a real server: the tier works under it, and only under its prefix."""
    process = valkey_server()
    rules = ["on", ">word", "~kvledger:tenant-a:*", "+get", "+set", "+exists", "+ping", "+info", "+client|setname"]
    if process.cli("COMMAND", "INFO", "CLIENT|SETINFO").strip() != "None":  # Valkey, Redis 7.2+; not Redis 7.0
        rules.append("+client|setinfo")
    process.cli("ACL", "SETUSER", "tenant-a", *rules)
    server = ValkeyServer(nodes=(("127.0.0.1", process.port),), username="tenant-a", password="word", timeout_s=1.0)
    confined = ValkeyTierIO(server=server, name="1:valkey", namespace=NS, rows=rows, payload_bytes=SIZES,
                            connections=2, seal=BlockSeal(SECRET), key_prefix=b"kvledger:tenant-a:")
    made.append(confined)
    assert run(confined, 1, "write", KEYS, WRITE_SLOTS).ok
    assert run(confined, 2, "read", KEYS, READ_SLOTS).ok and same_rows(rows)
    assert int(process.cli("EXISTS", store_key(NS, key(1), b"kvledger:tenant-a:").decode())) == 1
    outside = ValkeyTierIO(server=server, name="1:valkey", namespace=NS, rows=rows, payload_bytes=SIZES,
                           connections=2, seal=BlockSeal(SECRET))
    made.append(outside)
    outcome = run(outside, 3, "write", KEYS, WRITE_SLOTS)
    assert len(outcome.failed) == 6 and set(outcome.reasons) == {"unwritable"}
