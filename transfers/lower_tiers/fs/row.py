"""The file-system tier's row: block files in a directory, scanned at start; other
processes' files are looked up.
"""

from __future__ import annotations

from kvledger.transfers.lower_tiers.block_header import HEADER_BYTES
from kvledger.transfers.lower_tiers.contract import Lookup, TierType, WorkerSite
from kvledger.transfers.lower_tiers.fs.settings import FsTierSettings, check_fs_tier, parse_fs_tier
from kvledger.transfers.lower_tiers.fs.tier import FileLookup, FsTierIO, other_formats, scan_keys
from kvledger.transfers.lower_tiers.tier_jobs import TierIO


def _fs_lookup(tier: FsTierSettings, name: str, namespaces: tuple[bytes, ...]) -> Lookup:
    find = FileLookup(tier.path, namespaces, tier.gid)
    return Lookup(find=find, close=find.close)


def _fs_scan(tier: FsTierSettings, namespace: bytes) -> list[bytes]:
    return scan_keys(tier.path, namespace, tier.gid)


def _fs_open(tier: FsTierSettings, site: WorkerSite) -> TierIO:
    io = FsTierIO(root=tier.path, namespace=site.namespace, rows=site.rows, payload_bytes=site.payload_bytes,
                  threads=tier.threads, seal=tier.secret.seal(), gid=tier.gid, pack_bytes=tier.pack_bytes)
    site.write_identity(tier.path, site.namespace, site.identity, gid=tier.gid,
                        directory_fd=io.dir.space(site.namespace, create=True))
    if site.writes:  # the namespace's writer clears what its crashed predecessors left
        io.remove_leftovers()
    return io


ROW = TierType(
        settings=FsTierSettings, keys=("path", "root_dir", "capacity_bytes", "threads", "pack_bytes", "shared", "group"),
        parse=parse_fs_tier, check=check_fs_tier, header_bytes=lambda tier: HEADER_BYTES, where=lambda tier: {"path": tier.path},
        lookup=_fs_lookup, scan=_fs_scan, open_io=_fs_open, tombstones=True,
        other_formats=lambda tier: other_formats(tier.path, tier.gid))
