"""The Valkey tier: blocks as values in a Valkey (or Redis) server or cluster that replicas share.

settings       its settings: parsed without asking the server, checked against it at start
row            its row of the tier table: lookups, how a worker opens its I/O, other formats noted
tier           its I/O: values in pipelined batches on threads, and which keys the store holds
store          pipelined commands on one server, its replies not trusted
cluster_store  a cluster as its nodes, each read as one server, by the slot map
block_value    one block as a value: the header unpadded, under a namespaced key
"""

from kvledger.transfers.lower_tiers.valkey.row import ROW

__all__ = ["ROW"]
