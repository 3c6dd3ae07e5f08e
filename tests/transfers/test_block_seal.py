"""Blocks sealed with a tier's secret, as files and as values: a block is
served only when a holder of the secret wrote it. Whoever can write the
directory or the store, and even uses kvledger's own writer, cannot make a
replica with the secret load KV of their choosing."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from kvledger.transfers.lower_tiers import block_header as bh
from kvledger.transfers.lower_tiers.block_seal import GCM_TAG_BYTES, BlockSeal
from kvledger.transfers.lower_tiers.fs import block_file as bf
from kvledger.transfers.lower_tiers.valkey import block_value as bv

NS = bytes(range(16))
KEY = bytes(range(100, 116))
SECRET = b"a-tier-secret-of-32-bytes-length"
OTHER = b"another-secret-of-32-bytes-long!"

pytestmark = pytest.mark.fast


@pytest.fixture(params=[False, True], ids=["mac", "encrypted"])
def seal(request) -> BlockSeal:
    return BlockSeal(SECRET, encrypt=request.param)


def payload(size: int = 300_000) -> np.ndarray:
    return np.random.default_rng(size).integers(-128, 127, size, dtype=np.int8)


def read_file(path, seal: BlockSeal | None, size: int = 300_000) -> np.ndarray:
    out = np.empty(size, np.int8)
    bf.read_block_into(path, NS, KEY, out, seal)
    return out


def reason_reading(path, seal: BlockSeal | None) -> str:
    with pytest.raises(bh.BlockFileError) as caught:
        read_file(path, seal)
    return caught.value.reason


def forge(raw: bytes, header_bytes: int, *, flip: int) -> bytes:
    """What a writer without the secret can do with a sealed block: change the
    payload and make the header's checksums agree again (seal fields kept)."""
    fields = bh.check_header("x", raw[:header_bytes], NS, KEY, len(raw) - header_bytes, header_bytes, sealed=True)
    body = bytearray(raw[header_bytes:])
    body[flip] ^= 0x5A
    return bh.encode_header(NS, KEY, memoryview(body), header_bytes, fields) + bytes(body)


def test_a_sealed_file_round_trips_and_only_its_secret_reads_it(tmp_path, seal) -> None:
    data = payload()
    path = tmp_path / "b.kvb"
    bf.write_block(path, NS, KEY, data, seal)
    assert np.array_equal(read_file(path, seal), data)
    on_disk = path.read_bytes()[bh.HEADER_BYTES:]
    assert (on_disk == data.tobytes()) is not seal.encrypt  # encrypted at rest, or plain with a MAC
    assert reason_reading(path, BlockSeal(OTHER)) == "foreign"  # another deployment's: not an attack
    assert reason_reading(path, None) == "foreign"


def test_a_block_written_without_the_secret_is_forged_though_its_checksums_hold(tmp_path, seal) -> None:
    path = tmp_path / "b.kvb"
    bf.write_block(path, NS, KEY, payload(), None)  # kvledger's own writer, no secret
    assert reason_reading(path, seal) == "forged"


@pytest.mark.parametrize("flip", [0, 150_000, 299_999])
def test_a_sealed_file_changed_and_checksummed_again_is_forged(tmp_path, seal, flip) -> None:
    path = tmp_path / "b.kvb"
    bf.write_block(path, NS, KEY, payload(), seal)
    path.write_bytes(forge(path.read_bytes(), bh.HEADER_BYTES, flip=flip))
    assert reason_reading(path, seal) == "forged"


@pytest.mark.parametrize("where, detail", [
    (bh.HEADER_BYTES + 7, "corrupt: payload checksum mismatch"),  # the payload, its checksum left as it was
    (20, "corrupt: header checksum mismatch"),  # a header field (the namespace), its checksum left
    (0, "foreign: not a kvledger block file"),  # the magic
    (-1, "truncated"),  # the file cut short
])
def test_with_a_secret_a_block_that_fails_any_check_is_forged(tmp_path, seal, where, detail) -> None:
    """A tamperer does not choose how a change is counted: breaking a checksum, a field or the
    length as well still counts as forged (the check that failed first is in the detail). Without
    a secret, the same damage is what it looks like."""
    def damaged(name: str, with_seal: BlockSeal | None):
        path = tmp_path / name
        bf.write_block(path, NS, KEY, payload(), with_seal)
        raw = bytearray(path.read_bytes())
        if where < 0:
            del raw[len(raw) // 2:]
        else:
            raw[where] ^= 1
        path.write_bytes(bytes(raw))
        return path

    with pytest.raises(bh.BlockFileError) as caught:
        read_file(damaged("b.kvb", seal), seal)
    assert caught.value.reason == "forged" and f"fails verification before its seal ({detail}" in str(caught.value)
    assert reason_reading(damaged("plain.kvb", None), None) == detail.split(":")[0]


def test_with_a_secret_a_value_that_fails_any_check_is_forged(seal) -> None:
    data = payload()
    value = bytearray(bv.encode_value(NS, KEY, data, seal))
    head = bh.compact_header_bytes(KEY, sealed=True)
    out = np.empty_like(data)
    for damaged in (value[:head] + bytes([value[head] ^ 1]) + value[head + 1:], value[:-10], b"x" + value[1:]):
        with pytest.raises(bh.BlockFileError) as caught:
            bv.decode_value_into(bytes(damaged), NS, KEY, out, seal)
        assert caught.value.reason == "forged", caught.value
        row = np.frombuffer(bytearray(damaged[head:]), np.int8)
        if row.nbytes == data.nbytes:
            with pytest.raises(bh.BlockFileError) as caught:
                bv.check_in_place(bytes(damaged[:head]), NS, KEY, row, seal)
            assert caught.value.reason == "forged", caught.value


def test_a_rotation_reads_blocks_of_the_previous_secret_and_writes_with_the_new(tmp_path) -> None:
    data = payload()
    old, new = tmp_path / "old.kvb", tmp_path / "new.kvb"
    bf.write_block(old, NS, KEY, data, BlockSeal(OTHER))
    rotating = BlockSeal(SECRET, previous=OTHER)
    assert np.array_equal(read_file(old, rotating), data)
    bf.write_block(new, NS, KEY, data, rotating)
    assert np.array_equal(read_file(new, BlockSeal(SECRET)), data)
    assert reason_reading(new, BlockSeal(OTHER)) == "foreign"  # a replica not yet given the new secret


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_rotation_ends_at_its_date_and_the_old_secret_is_then_refused_as_forged(tmp_path, encrypt) -> None:
    """After `previous_secret_until`, a block sealed with the old secret is one a leaker could
    have made: refused as forged, while the new secret's blocks read on."""
    data = payload()
    old, new = tmp_path / "old.kvb", tmp_path / "new.kvb"
    bf.write_block(old, NS, KEY, data, BlockSeal(OTHER, encrypt=encrypt))
    now = [1000.0]
    rotating = BlockSeal(SECRET, previous=OTHER, encrypt=encrypt, previous_until=2000.0, clock=lambda: now[0])
    bf.write_block(new, NS, KEY, data, rotating)
    assert np.array_equal(read_file(old, rotating), data)  # before the end: read
    now[0] = 2000.0
    assert reason_reading(old, rotating) == "forged"
    assert np.array_equal(read_file(new, rotating), data)
    trusted = rotating.trusted()  # each secret's two ids: MAC-sealed (and older encrypted) blocks, encrypted ones
    assert list(trusted.values()) == ["no end"] * 2 + ["1970-01-01T00:33:20Z"] * 2 and len(trusted) == 4


def test_each_encrypted_block_has_a_key_of_its_own_and_the_salt_is_bound_to_it(tmp_path) -> None:
    """A random 96-bit nonce under one key per secret repeats with a chance of 2^-32 by 2^32 blocks;
    a 16-byte salt per block picks each block's key. Another salt fails the block as forged."""
    seal = BlockSeal(SECRET, encrypt=True)
    data = payload()
    paths = [tmp_path / f"{n}.kvb" for n in range(2)]
    for path in paths:
        bf.write_block(path, NS, KEY, data, seal)
    raws = [p.read_bytes() for p in paths]
    fields = [bh.check_header("x", raw[:bh.HEADER_BYTES], NS, KEY, data.nbytes, sealed=True) for raw in raws]
    assert fields[0].key_id == fields[1].key_id != seal.key_id  # the id of blocks with a key each
    salts = [f.tag[GCM_TAG_BYTES:] for f in fields]
    assert salts[0] != salts[1] and all(any(salt) for salt in salts)
    assert np.array_equal(read_file(paths[0], seal), data)
    salted = attrs.evolve(fields[0], tag=fields[0].tag[:GCM_TAG_BYTES] + bytes([salts[0][0] ^ 1]) + salts[0][1:])
    body = raws[0][bh.HEADER_BYTES:]
    paths[0].write_bytes(bh.encode_header(NS, KEY, memoryview(body), bh.HEADER_BYTES, salted) + body)
    assert reason_reading(paths[0], seal) == "forged"
    assert reason_reading(paths[0], BlockSeal(SECRET)) == "forged"  # a MAC-sealing reader of the same secret too


def test_a_reader_that_requires_encryption_refuses_a_block_sealed_in_plaintext(tmp_path) -> None:
    """`encrypt: "required"`: a holder of the secret writing without encryption (a replica left
    on `encrypt: false`) is not served; an encrypted block is."""
    data = payload()
    plain, sealed = tmp_path / "plain.kvb", tmp_path / "sealed.kvb"
    bf.write_block(plain, NS, KEY, data, BlockSeal(SECRET))
    bf.write_block(sealed, NS, KEY, data, BlockSeal(SECRET, encrypt=True))
    strict = BlockSeal(SECRET, encrypt=True, require_encrypted=True)
    assert reason_reading(plain, strict) == "foreign"
    assert np.array_equal(read_file(sealed, strict), data)
    assert np.array_equal(read_file(plain, BlockSeal(SECRET, encrypt=True)), data)  # not required: read


def test_a_sealed_value_round_trips_and_a_forged_one_is_refused(seal) -> None:
    data = payload()
    value = bv.encode_value(NS, KEY, data, seal)
    head = bh.compact_header_bytes(KEY, sealed=True)
    assert len(value) == head + data.nbytes
    out = np.empty_like(data)
    bv.decode_value_into(value, NS, KEY, out, seal)
    assert np.array_equal(out, data)
    # In place, as the tier reads it: the head apart, the payload already in its row.
    row = np.frombuffer(bytearray(value[head:]), np.int8)
    bv.check_in_place(value[:head], NS, KEY, row, seal)
    assert np.array_equal(row, data)
    for bad, why in ((forge(value, head, flip=3), "forged"), (bv.encode_value(NS, KEY, data), "forged")):
        with pytest.raises(bh.BlockFileError) as caught:
            bv.decode_value_into(bad, NS, KEY, out, seal)
        assert caught.value.reason == why


def test_a_key_length_that_points_past_the_header_is_corruption_not_a_crash() -> None:
    value = bytearray(bv.encode_value(NS, KEY, payload(1000)))
    # the key length field: the last two bytes of the fixed part
    fixed = bh._FIXED.size
    value[fixed - 2:fixed] = (200).to_bytes(2, "little")
    with pytest.raises(bh.BlockFileError) as caught:
        bv.decode_value_into(bytes(value), NS, KEY, np.empty(1000, np.int8))
    assert caught.value.reason == "corrupt"


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        BlockSeal(b"short")
