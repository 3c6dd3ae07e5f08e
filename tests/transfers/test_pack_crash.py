"""A writer killed in the middle of writing packs (SIGKILL, at seeded moments)
leaves no block that reads as good and is not: every name left either reads
back the bytes its key was written with or fails its checks, and the next
worker's start clears what it left aside. A real process, a real file system."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvledger.transfers.lower_tiers.fs.tier import remove_leftovers, scan_keys
from tests.transfers.test_fs_tier import NS, ROW_BYTES, key, leftovers, made_tiers, random_rows

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]
ROWS = 64
WRITER = """
import sys
sys.path.insert(0, {repo!r})
from kvledger.transfers.lower_tiers.fs.tier import FsTierIO
from tests.transfers.test_fs_tier import NS, ROW_BYTES, key, random_rows

io = FsTierIO(root={root!r}, namespace=NS, rows=random_rows({rows}), payload_bytes=(ROW_BYTES,), threads=4,
              pack_bytes=2 << 20)
job = {first_job}
while True:  # packs of 32 blocks, four jobs in flight, until killed
    ids = []
    for _ in range(4):
        numbers = range(job * 32, job * 32 + 32)
        io.write(job, (tuple(key(n) for n in numbers),), (tuple(n % {rows} for n in numbers),))
        ids.append(job)
        job += 1
    io.wait(ids, 60)
    io.poll()
    if job == {first_job} + 4:
        print("writing", flush=True)
"""


def _kill_while_writing(root: Path, first_job: int, after_s: float) -> None:
    code = WRITER.format(repo=str(REPO), root=str(root), rows=ROWS, first_job=first_job)
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "writing"
        time.sleep(after_s)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(30)


def test_a_writer_killed_mid_pack_leaves_no_block_that_reads_as_good_and_is_not(tmp_path) -> None:
    root = tmp_path / "tier"
    moments = random.Random(7)
    for round_ in range(3):
        _kill_while_writing(root, first_job=round_ * 10_000, after_s=moments.uniform(0.02, 0.3))
    names = scan_keys(str(root), NS)
    assert len(names) >= 3 * 4 * 32  # the packs each writer finished before it was killed
    expected = random_rows(ROWS)
    with made_tiers(threads=2, pack_bytes=2 << 20) as tiers:
        reader = tiers(root, rows=torch.zeros((len(names), ROW_BYTES), dtype=torch.int8), sizes=(ROW_BYTES,))
        numbers = [int.from_bytes(name[16:], "big") for name in names]
        assert names == [key(n) for n in numbers]
        reader.read(1, (tuple(names),), (tuple(range(len(names))),))
        reader.wait([1], 60)
        (outcome,) = reader.poll()
        failed = {i for _g, i in outcome.failed}
        for slot, number in enumerate(numbers):
            if slot not in failed:  # read as good: then it is the block its key was written with
                assert torch.equal(reader.rows[slot], expected[number % ROWS]), number
        assert not failed or set(outcome.reasons) <= {"truncated", "corrupt", "missing"}
    aside = leftovers(root)  # what the writers had aside when killed (a pack not yet linked) ...
    assert all(path.name.endswith(".tmp") for path in aside)
    assert remove_leftovers(str(root), NS, grace_s=0) == len(aside)  # ... the next worker's start clears
    assert leftovers(root) == []
    assert scan_keys(str(root), NS) == names  # and the names it found stay
