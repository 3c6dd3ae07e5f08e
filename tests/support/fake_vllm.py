"""The parts of vLLM the step planner reads, as plain data.

A test (or a benchmark of the planner) plays vLLM's scheduler by hand: it
sets each request's block table per group (block 0 is vLLM's null block),
its hashes and token counts, says which requests a step schedules, admits or
preempts, and asks the planner for the step's events. The engine applies
them strictly, so an order the engine would reject fails where it happens.
"""

from __future__ import annotations

import attrs

from kvledger.engine.planner import Admission, plan_step
from kvledger.engine.reducer import reduce, reduce_step
from kvledger.engine.state import State, initial_state
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig


@attrs.frozen
class Block:
    block_id: int


@attrs.frozen
class CachedRequests:
    """vLLM's `CachedRequestData`, the columns the planner reads."""

    req_ids: list[str]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]
    new_block_ids: list[tuple | None]


@attrs.define
class Request:
    num_tokens: int
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = attrs.field(factory=list)
    num_prompt_tokens: int = attrs.field(default=attrs.Factory(lambda self: self.num_tokens, takes_self=True))


class FakeVllm:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.state: State = initial_state(config)
        self.requests: dict[str, Request] = {}
        self.tables: tuple[dict[str, list[Block]], ...] = tuple({} for _ in config.groups)
        self.step_index = 0
        self.given: set[str] = set()  # requests given blocks since the last plan (vLLM's `new_block_ids`)
        self.say_grown = True  # False: the planner is not told, and compares every table
        # False: the planner is not given vLLM's cached requests (their token counts
        # and new blocks), and reads each request and compares every table instead.
        self.say_counts = True
        self.ran: set[str] = set()  # requests scheduled before: vLLM's cached requests
        self.cached_reversed = False  # True: in the reverse of vLLM's order, so matched by none
        self.sessions: set[str] = set()  # streaming sessions: their hashes compared in every step
        self.log: list[ev.Event] = []
        self.effects: list = []  # every effect the engine produced, in order

    def add(self, rid: str, num_tokens: int, hashes: tuple[bytes, ...]) -> None:
        self.requests[rid] = Request(num_tokens, 0, list(hashes))
        self.apply([ev.RequestAdded(request_id=rid, num_prompt_tokens=num_tokens, block_hashes=hashes)])

    def give(self, rid: str, *ids_by_group: tuple[int, ...]) -> None:
        """vLLM appends these blocks to the request's table, per group."""
        for table, ids in zip(self.tables, ids_by_group):
            table.setdefault(rid, []).extend(Block(i) for i in ids)
        self.given.add(rid)

    def null_out(self, rid: str, group: int, *positions: int) -> None:
        """vLLM frees window blocks: their positions now hold the null block."""
        for position in positions:
            self.tables[group][rid][position] = Block(ev.NULL_BLOCK_ID)

    def drop(self, rid: str) -> None:
        """vLLM freed every block of the request (a preemption)."""
        for table in self.tables:
            table.pop(rid, None)
        self.requests[rid].num_computed_tokens = 0

    def table(self, rid: str) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(b.block_id for b in t.get(rid, ())) for t in self.tables)

    def engine_table(self, rid: str) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(t) for t in self.state.core.requests[rid].table)

    def plan(self, scheduled: dict[str, int] | None = None, *, admitted: tuple[Admission, ...] = (),
             preempted: tuple[str, ...] = (), near_eviction: tuple[int, ...] = ()) -> list[ev.Event]:
        scheduled = scheduled or {}
        events = plan_step(
            self.state, step_index=self.step_index + 1, preempted=preempted, scheduled=scheduled,
            admissions=admitted, requests=self.requests, tables=self.tables, near_eviction=near_eviction,
            cached=self.cached(scheduled) if self.say_counts else None, sessions=self.sessions)
        self.given.clear()
        self.ran.update(scheduled)
        if scheduled:
            self.step_index += 1
        return events

    def cached(self, scheduled: dict[str, int]) -> CachedRequests:
        """As vLLM's scheduler output gives them: the scheduled requests that ran
        before, in scheduling order (a first-scheduled one is a new request)."""
        ids = [rid for rid in scheduled if rid in self.ran]
        if self.cached_reversed:
            ids.reverse()
        requests = [self.requests[rid] for rid in ids]
        return CachedRequests(
            ids, [r.num_computed_tokens for r in requests], [r.num_tokens - r.num_prompt_tokens for r in requests],
            [() if rid in self.given or not self.say_grown else None for rid in ids])

    def apply(self, events: list[ev.Event]) -> tuple:
        """Strict: the engine raises on the first event it would reject."""
        self.log.extend(events)
        if not events:
            return ()
        if len(events) == 1:
            self.state, effects = reduce(self.state, events[0], strict=True)
        else:
            self.state, effects = reduce_step(self.state, events, strict=True)
        self.effects.extend(effects)
        return effects

    def run(self, scheduled: dict[str, int] | None = None, **step: object) -> list[ev.Event]:
        """Plan the step, apply it, and move vLLM's computed counts on."""
        events = self.plan(scheduled, **step)  # type: ignore[arg-type]
        self.apply(events)
        for rid, count in (scheduled or {}).items():
            self.requests[rid].num_computed_tokens += count
        return events
