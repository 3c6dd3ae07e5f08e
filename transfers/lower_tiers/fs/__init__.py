"""The file-system tier: block files in a directory (local NVMe, NFS, a parallel file system).

settings    its settings: parsed without touching the disk, checked against it at start
row         its row of the tier table: lookups, the start-up scan, how a worker opens its I/O
tier        its I/O: block files on threads, the scan of what a directory holds, other formats found
block_file  one block as a file: the header padded to 4096 bytes, written aside and renamed
block_pack  a write job's small blocks as one file, each key's name a link to it
tier_dir    the directory held by descriptor, reached per component, never through a link
"""

from kvledger.transfers.lower_tiers.fs.row import ROW

__all__ = ["ROW"]
