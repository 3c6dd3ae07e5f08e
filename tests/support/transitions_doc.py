"""Render the transition tables of `engine/transitions.py` as Markdown.

`render()` returns the text of `docs/transitions.md`;
`tests/engine/test_transitions.py` checks the committed file equals it
(`KVLEDGER_UPDATE_GOLDEN=1` rewrites it).
"""

from __future__ import annotations

from kvledger.engine.state import RequestStatus, SlotState
from kvledger.engine.transitions import JOB_MOVES, REQUEST_MOVES, SLOT_MOVES, TIER_KEY_MOVES

_ILLEGAL = "·"

# What the pseudo-kinds stand for: one outcome of an event that has two.
_NOTES = {
    "blocks_allocated+load": "a `blocks_allocated` that admits a tier hit (`num_external_tokens > 0`)",
    "load_ended": "the last worker's `load_completed` or `load_failed` for the request's load",
    "load_failed+recompute": "a load that ended failed with several KV groups, or with one group at "
                             "its first block: vLLM frees the blocks and recomputes the request (an "
                             "aborting request is forgotten either way)",
}


def _status(status: RequestStatus | None, *, left: bool) -> str:
    if status is None:
        return "(new)" if left else "gone"
    return status.value


def _request_table() -> list[str]:
    columns: list[RequestStatus | None] = [None, *RequestStatus]
    kinds = list(dict.fromkeys(kind for _, kind in REQUEST_MOVES))
    lines = [
        "| event \\ from | " + " | ".join(f"`{_status(s, left=True)}`" for s in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for kind in kinds:
        cells = []
        for status in columns:
            if (status, kind) in REQUEST_MOVES:
                cells.append(f"→ `{_status(REQUEST_MOVES[(status, kind)], left=False)}`")
            else:
                cells.append(_ILLEGAL)
        lines.append(f"| `{kind}` | " + " | ".join(cells) + " |")
    return lines


def _notes() -> list[str]:
    kinds = dict.fromkeys(kind for _, kind in REQUEST_MOVES)
    return ["Pseudo-kinds, chosen by a fact of the event:", ""] + [
        f"- `{kind}`: {note}." for kind, note in _NOTES.items() if kind in kinds
    ]


def _slot_table() -> list[str]:
    lines = ["| from | action | to |", "|---|---|---|"]
    for (state, action), target in SLOT_MOVES.items():
        lines.append(f"| `{SlotState(state).name.lower()}` | `{action}` | `{SlotState(target).name.lower()}` |")
    return lines


def _moves_table(moves: dict) -> list[str]:
    def name(state: object) -> str:
        return "gone" if state is None else str(getattr(state, "value", state))

    lines = ["| from | action | to |", "|---|---|---|"]
    for (state, action), target in moves.items():
        lines.append(f"| `{'(new)' if state is None else name(state)}` | `{action}` | `{name(target)}` |")
    return lines


def render() -> str:
    lines = [
        "# Transitions",
        "",
        "<!-- Rendered by tests/support/transitions_doc.py from engine/transitions.py; do not edit by hand.",
        "     KVLEDGER_UPDATE_GOLDEN=1 pytest tests/engine/test_transitions.py rewrites it. -->",
        "",
        "Every legal state move of the engine, as data. The reducer takes from these tables both",
        "whether a move is legal and where it leads: a move that is not here is a protocol violation,",
        "reported as `ReportViolation(code=\"illegal_request_event\")` with the state unchanged (strict",
        "mode raises). A request's status on the left of a `step_scheduled` move is one a step may",
        "schedule. Tier slots change state only in `engine/slots.py`, which takes each action's",
        "target from the slot table.",
        "",
        "## Requests",
        "",
        "Rows are events, columns the request's status before it; a cell is the status after it.",
        f"`(new)` is a request the engine does not know, `gone` one it forgets, and `{_ILLEGAL}` an",
        "illegal move.",
        "",
        *_request_table(),
        "",
        *_notes(),
        "",
        "## Tier slots",
        "",
        "A slot leaves the index (stops being offered) on eviction, failure or reset, but it is freed",
        "only when no job still reads or writes it. A slot being loaded is `stored` with a load count",
        "above zero.",
        "",
        *_slot_table(),
        "",
        "## Keys in a tier below host memory",
        "",
        "What the engine knows of a key in one lower tier (`engine/lower.py`): absent, being written",
        "by a spill, or held whole. A key being read (promoted through a host slot by a load) is",
        "`held` with a read count above zero, and eviction takes only keys no read counts. A reset",
        "removes what is held at once, and a key being written when its stale spill ends.",
        "",
        *_moves_table(TIER_KEY_MOVES),
        "",
        "## Jobs",
        "",
        "A transfer (a store, a load, a spill) from its start to its last worker's report. A report",
        "from a worker that already reported, or for a job not in flight, is a protocol violation. Only",
        "a store is flushed (the worker waits for it before the step's forward, and its source blocks",
        "are free after); a reset marks any job stale, its outcome no longer counted, in its stage.",
        "",
        *_moves_table(JOB_MOVES),
        "",
    ]
    return "\n".join(lines)
