"""Small builders shared by the engine's example tests.

`Engine` wraps a state handle and feeds it events, strict by default, so a
test reads as the sequence of facts it drives. `seed_tier` puts keys straight
into the tier for lookup cases that are easier to build by hand than by a
store round trip; the result still passes `invariants.check`.
"""

from __future__ import annotations

import hashlib

from kvledger.engine import effects as fx
from kvledger.engine.digest import digest
from kvledger.engine.reducer import ProtocolViolation, reduce
from kvledger.engine.state import SlotState, State, initial_state
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig, GroupSpec

FULL = GroupSpec(group_id=0, kind="full", block_size=32)
SLIDING = GroupSpec(group_id=1, kind="sliding", block_size=32, window=64)


def make_config(**overrides: object) -> EngineConfig:
    """Full attention (32) next to a 64-token sliding window (32): alignment 32."""
    fields: dict = dict(groups=(FULL, SLIDING), hash_block_size=32, num_device_blocks=64, num_tier_slots=32)
    fields.update(overrides)
    return EngineConfig(**fields)


# The simulated workloads' configurations (the stateful machine, the check-agreement
# property tests): one group; windows; pin mode with ARC; mamba; mixed block
# sizes; lazy stores. Two keep one store job per request (the older logs' way).
SIMULATED_CONFIGS = [
    EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=16),),
                 hash_block_size=16, num_device_blocks=24, num_tier_slots=12),
    EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=32),
                         GroupSpec(group_id=1, kind="sliding", block_size=32, window=64)),
                 hash_block_size=32, num_device_blocks=32, num_tier_slots=16, world_size=2,
                 store_jobs="request"),
    EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=32),
                         GroupSpec(group_id=1, kind="sliding", block_size=32, window=64)),
                 hash_block_size=32, num_device_blocks=32, num_tier_slots=16, protection="pin", policy="arc"),
    EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=32),
                         GroupSpec(group_id=1, kind="mamba", block_size=64)),
                 hash_block_size=32, num_device_blocks=32, num_tier_slots=16, policy="arc"),
    EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=16),
                         GroupSpec(group_id=1, kind="sliding", block_size=32, window=48)),
                 hash_block_size=16, num_device_blocks=40, num_tier_slots=20, store_jobs="request"),
    EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=32),
                         GroupSpec(group_id=1, kind="sliding", block_size=32, window=64)),
                 hash_block_size=32, num_device_blocks=32, num_tier_slots=16, store_mode="lazy"),
    # A host tier smaller than the working set, with a disk below it.
    EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=16),),
                 hash_block_size=16, num_device_blocks=24, num_tier_slots=4,
                 lower_tiers=({"name": "1:fs", "num_blocks": 16},)),
    EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=32),
                         GroupSpec(group_id=1, kind="sliding", block_size=32, window=64)),
                 hash_block_size=32, num_device_blocks=32, num_tier_slots=6, world_size=2, policy="arc",
                 lower_tiers=({"name": "1:fs", "num_blocks": 24},)),
    # vLLM's store threshold, its tracker small enough to forget, and prompt blocks alone stored.
    EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=16),
                         GroupSpec(group_id=1, kind="sliding", block_size=16, window=32)),
                 hash_block_size=16, num_device_blocks=40, num_tier_slots=16, store_threshold=2,
                 max_tracker_size=12, offload_prompt_only=True),
    # Load or recompute by the clock, a disk below host memory.
    EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=16),
                         GroupSpec(group_id=1, kind="sliding", block_size=16, window=32)),
                 hash_block_size=16, num_device_blocks=40, num_tier_slots=8, restore_budget="auto",
                 lower_tiers=({"name": "1:fs", "num_blocks": 24},)),
]


def full_only_config(**overrides: object) -> EngineConfig:
    return make_config(groups=(FULL,), **overrides)


def chain(count: int, tag: str = "a") -> tuple[bytes, ...]:
    """`count` distinct 32-byte stand-ins for vLLM chain hashes."""
    return tuple(hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=32).digest() for i in range(count))


def key(hash_: bytes, group_id: int) -> bytes:
    return hash_ + group_id.to_bytes(4, "big")


def violations(effects: tuple) -> list[str]:
    return [e.code for e in effects if isinstance(e, fx.ReportViolation)]


class Engine:
    """A state handle plus helpers that build well-formed events."""

    def __init__(self, config: EngineConfig | None = None, *, strict: bool = True) -> None:
        self.config = config or make_config()
        self.state: State = initial_state(self.config)
        self.strict = strict
        self.step_index = -1
        self.log: list[ev.Event] = []

    @property
    def core(self):
        return self.state.core

    @property
    def groups(self) -> int:
        return len(self.config.groups)

    def apply(self, event: ev.Event) -> tuple:
        self.state, effects = reduce(self.state, event, strict=self.strict)
        self.log.append(event)
        return effects

    def reject(self, event: ev.Event) -> str:
        """Apply an illegal event in non-strict mode; check it changed nothing
        and reported exactly one violation; return the violation's code. Then
        check strict mode raises the same code."""
        before = digest(self.state)
        self.state, effects = reduce(self.state, event, strict=False)
        assert digest(self.state) == before, "a rejected event changed the state"
        assert len(effects) == 1 and isinstance(effects[0], fx.ReportViolation), effects
        code = effects[0].code
        assert effects[0].event_kind == event.kind
        try:
            reduce(self.state, event, strict=True)
        except ProtocolViolation as raised:
            assert raised.code == code
        else:
            raise AssertionError("strict mode accepted an event non-strict mode rejected")
        assert digest(self.state) == before, "strict mode changed the state before raising"
        return code

    # Scheduler facts.

    def add(self, rid: str, num_tokens: int, hashes: tuple[bytes, ...] | None = None, tag: str = "a") -> tuple:
        if hashes is None:
            hashes = chain(num_tokens // self.config.hash_block_size, tag)
        return self.apply(ev.RequestAdded(request_id=rid, num_prompt_tokens=num_tokens, block_hashes=hashes))

    def alloc(self, rid: str, *block_ids: tuple[int, ...], ext: int = 0) -> tuple:
        return self.apply(ev.BlocksAllocated(request_id=rid, block_ids=block_ids, num_external_tokens=ext))

    def touch(self, rid: str, *block_ids: tuple[int, ...]) -> tuple:
        return self.apply(ev.BlocksTouched(request_id=rid, block_ids=block_ids))

    def free(self, rid: str, *block_ids: tuple[int, ...]) -> tuple:
        return self.apply(ev.BlocksFreed(request_id=rid, block_ids=block_ids))

    def step(self, *scheduled: tuple[str, int, int]) -> tuple:
        """`scheduled` is (request_id, num_computed_tokens, num_scheduled_tokens)."""
        self.step_index += 1
        return self.apply(ev.StepScheduled(
            step_index=self.step_index, request_ids=tuple(s[0] for s in scheduled),
            num_computed_tokens=tuple(s[1] for s in scheduled),
            num_scheduled_tokens=tuple(s[2] for s in scheduled)))

    def next_step_event(self, *scheduled: tuple[str, int, int]) -> ev.StepScheduled:
        return ev.StepScheduled(
            step_index=self.step_index + 1, request_ids=tuple(s[0] for s in scheduled),
            num_computed_tokens=tuple(s[1] for s in scheduled),
            num_scheduled_tokens=tuple(s[2] for s in scheduled))

    def finish(self, rid: str) -> tuple:
        table = tuple(tuple(t) for t in self.core.requests[rid].table)
        return self.apply(ev.RequestFinished(request_id=rid, block_ids=table))

    def finish_event(self, rid: str) -> ev.RequestFinished:
        return ev.RequestFinished(request_id=rid, block_ids=tuple(tuple(t) for t in self.core.requests[rid].table))

    def preempt(self, rid: str) -> tuple:
        return self.apply(ev.RequestPreempted(request_id=rid))

    def resume(self, rid: str) -> tuple:
        return self.apply(ev.RequestResumed(request_id=rid))

    def abort(self, rid: str) -> tuple:
        return self.apply(ev.RequestAborted(request_id=rid))

    # Transfer outcomes.

    def store_done(self, job_id: int, worker: int = 0) -> tuple:
        return self.apply(ev.StoreCompleted(job_id=job_id, worker_index=worker))

    def load_done(self, job_id: int, worker: int = 0) -> tuple:
        return self.apply(ev.LoadCompleted(job_id=job_id, worker_index=worker))

    def finish_all_jobs(self) -> None:
        """Complete every job, and the spills their completions start, until none is left."""
        while self.core.jobs:
            for job_id in sorted(self.core.jobs):
                job = self.core.jobs.get(job_id)
                for worker in range(self.config.world_size):
                    if job is not None and job.pending_workers >> worker & 1:
                        if job.kind.value in ("store", "spill"):  # a spill reports as a store
                            self.store_done(job_id, worker)
                        else:
                            self.load_done(job_id, worker)

    # Composite setups.

    def run_and_store(self, rid: str, num_tokens: int, *block_ids: tuple[int, ...], tag: str = "a") -> None:
        """Add a request, allocate its blocks, compute its prompt, store it, and
        complete every store."""
        self.add(rid, num_tokens, tag=tag)
        self.alloc(rid, *block_ids)
        self.step((rid, 0, num_tokens))
        self.finish_all_jobs()


def only(effects: tuple, kind: type) -> list:
    return [e for e in effects if isinstance(e, kind)]


def admits(rid: str, effects: tuple) -> tuple:
    """An admission's effects less the `RequestAdmitted` that comes first, checked to name `rid`."""
    assert effects and type(effects[0]) is fx.RequestAdmitted and effects[0].request_id == rid, effects[:1]
    assert not only(effects[1:], fx.RequestAdmitted)
    return effects[1:]


def seed_tier(state: State, keys: list[bytes] | tuple[bytes, ...], slot_state: SlotState = SlotState.STORED) -> None:
    """Index `keys` in fresh slots, as if stored; STORED keys join the policy."""
    core = state.core
    for k in keys:
        slot = core.next_fresh_slot
        core.next_fresh_slot += 1
        core.slot_of_key[k] = slot
        core.slot_key[slot] = k
        core.slot_state[slot] = slot_state
        if slot_state == SlotState.STORED:
            core.policy.insert(k, False)
