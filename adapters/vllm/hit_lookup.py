"""`get_num_new_matched_tokens` and what it must remember between vLLM's calls.

vLLM asks about a waiting request in every step until it admits it, and
admits several requests before the engine sees any of them. So four things
outlive one call, each dropped as soon as it stops being true:
- the local hit vLLM passed to the last lookup, which the step's admission
  carries (`update_state_after_alloc` does not pass it again);
- each waiting request's last answer, handed back to the next lookup
  (`engine.lookup` returns it unwalked while what it rests on holds);
- the host slots each request's last hit would take from the evictable pool
  to promote its keys from a lower tier (or to read idle host keys in place),
  and the sums of those admitted this step: a later lookup in the same step
  must not count them free, nor count on idle host keys their promotions
  will evict.

With a shared tier below host memory, keys no tier is known to hold are
first looked up there (`SchedulerTiers.ask`), and the answer is "ask again"
(None) until what the lookup found has entered the log.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvledger.engine import queries
from kvledger.engine.lookup import LookupResult, lookup
from kvledger.engine.planner import Admission
from kvledger.engine.state import State
from kvledger.events import types as ev

if TYPE_CHECKING:
    from kvledger.adapters.vllm.lower_tiers import SchedulerTiers


class HitLookups:
    """`apply` enters events (a lookup's findings) into the engine; `state` reads it."""

    def __init__(self, state: Callable[[], State], apply: Callable[[list[ev.Event]], object],
                 tiers: SchedulerTiers | None) -> None:
        self._state = state
        self._apply = apply
        self._tiers = tiers if tiers is not None and tiers.shared else None  # only shared tiers are asked
        self._local_hit: dict[str, int] = {}
        self._last_answer: dict[str, LookupResult] = {}
        self._pending_promotions: dict[str, tuple[int, int]] = {}  # slots taken, of them promotions
        self._promised = 0
        self._promoting = 0  # of the slots promised, those of promotions
        self._admitted: list[Admission] = []  # this step's, in vLLM's order

    def hit(self, rid: str, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's answer: (tokens to load, whether asynchronously), or (None, False): ask next step."""
        self._local_hit[rid] = num_computed_tokens
        tiers = self._tiers
        if tiers is not None:
            self._enter(tiers.answers())
        result = lookup(self._state(), rid, num_computed_tokens, self._promised, self._last_answer.get(rid),
                        self._promoting)
        self._last_answer[rid] = result
        if result.ready and tiers is not None:
            # Keys beyond the hit that another process may have written: look once.
            wanted = queries.unknown_keys(self._state(), rid, num_computed_tokens + result.num_hit_tokens)
            if tiers.ask(rid, wanted):
                return None, False  # the lookup's answer enters the log before the next try
            if self._enter(tiers.answers()):
                result = lookup(self._state(), rid, num_computed_tokens, self._promised,
                                promotions_promised=self._promoting)
        if not result.ready:
            return None, False  # a needed key is still being stored or loaded: ask next step
        self._pending_promotions[rid] = (result.slots_taken, result.promotions)
        return result.num_hit_tokens, result.num_hit_tokens > 0  # loads are asynchronous (WAITING_FOR_REMOTE_KVS)

    def _enter(self, learned: list[ev.TierKeysFound | ev.TierLookupFailed]) -> bool:
        """Apply what lookups learned; True when one found keys (the hit may be longer)."""
        if learned:
            self._apply(list(learned))
        return any(type(event) is ev.TierKeysFound for event in learned)

    def admitted(self, request_id: str, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks (`update_state_after_alloc`)."""
        answer = self._last_answer.pop(request_id, None)
        if queries.request_status(self._state(), request_id) in queries.ADMITTABLE:
            budget = None
            if answer is not None and answer.budget is not None:  # `restore_budget: "auto"` cut its hit
                offered, load_us, compute_us = answer.budget
                budget = (offered, answer.num_hit_tokens, load_us, compute_us)
            self._admitted.append(Admission(request_id, self._local_hit.pop(request_id, 0), num_external_tokens,
                                            budget))
            if num_external_tokens:  # admitted with its hit: its promotions are spoken for
                slots, promotions = self._pending_promotions.pop(request_id, (0, 0))
                self._promised += slots
                self._promoting += promotions

    def take_admissions(self) -> list[Admission]:
        """This step's admissions, for the step planner; the step's promises end with it."""
        admitted, self._admitted = self._admitted, []
        self._promised = self._promoting = 0
        self._pending_promotions.clear()
        return admitted

    def rewound(self, request_id: str) -> None:
        """A kept answer may rest on rewound keys."""
        self._last_answer.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self._local_hit.pop(request_id, None)
        self._last_answer.pop(request_id, None)
        self._pending_promotions.pop(request_id, None)
