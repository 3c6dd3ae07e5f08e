"""kvledger's connector against the installed vLLM's connector API.

vLLM calls a connector through `KVConnectorBase_V1` (and `SupportsHMA`), and
the API moves between minor releases. A method kvledger overrides with another
signature fails only when vLLM calls it, maybe on a rare path; a hook vLLM
renamed is never called at all, silently. So: every method kvledger's class
defines that a base also defines has the base's parameters (names and kinds, in
order, no extra required one) and kind (method, classmethod, staticmethod,
property), and every other public name it defines is kvledger's own or a hook
that a newer supported vLLM adds. Runs under vLLM 0.32 (`make test`) and 0.33
(`make test-vllm033`).
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")  # before the imports that need it
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

from kvledger.adapters.vllm import KVLedgerConnector

pytestmark = pytest.mark.vllm

BASES = (KVConnectorBase_V1, SupportsHMA)

# Public names kvledger's connector defines that are no vLLM hook.
KVLEDGER_OWN = frozenset({"scheduler", "worker"})

# Hooks a newer supported vLLM's base defines and an older one lacks (the
# release that added them): kvledger may define them on the older one, where
# nothing calls them.
ADDED_IN = {"supports_sleep_mode": (0, 33), "unregister_kv_caches": (0, 33), "restore_kv_caches": (0, 33)}

_VAR = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def vllm_minor() -> tuple[int, int]:
    import vllm

    from kvledger.adapters.vllm_version import parse_minor

    return parse_minor(vllm.__version__)


def static_attr(cls: type, name: str):
    """`name` as defined on `cls` or the first class of its MRO that has it, undecorated."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    raise AttributeError(name)


def kind(attr) -> str:
    if isinstance(attr, staticmethod):
        return "staticmethod"
    if isinstance(attr, classmethod):
        return "classmethod"
    if isinstance(attr, property):
        return "property"
    return "method" if inspect.isfunction(attr) else "attribute"


def parameters(attr) -> list[inspect.Parameter]:
    """The parameters a caller passes: without `self` or `cls`."""
    function = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
    params = list(inspect.signature(function).parameters.values())
    return params if isinstance(attr, staticmethod) else params[1:]


def signature_problems(name: str, ours, base) -> list[str]:
    """Where a call written against `base`'s signature would not bind to `ours` alike."""
    mine, theirs = parameters(ours), parameters(base)
    problems = []
    for index, expected in enumerate(theirs):
        if index >= len(mine):
            problems.append(f"{name}: lacks the base's parameter {expected.name!r}")
            break
        got = mine[index]
        if got.kind != expected.kind or (expected.kind not in _VAR and got.name != expected.name):
            problems.append(f"{name}: parameter {index + 1} is {got.name!r} ({got.kind.description}), "
                            f"the base's is {expected.name!r} ({expected.kind.description})")
        elif expected.default is not inspect.Parameter.empty and got.default is inspect.Parameter.empty:
            problems.append(f"{name}: requires {got.name!r}, which the base makes optional")
    for extra in mine[len(theirs):]:
        if extra.kind not in _VAR and extra.default is inspect.Parameter.empty:
            problems.append(f"{name}: requires {extra.name!r}, which the base does not pass")
    return problems


def defined_names(cls: type) -> set[str]:
    """The names `cls` and its classes up to vLLM's bases define: public ones,
    `__init__`, and private ones that override a base's."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass in BASES or klass.__module__.startswith("vllm.") or klass is object:
            continue
        names.update(vars(klass))
    in_base = {n for base in BASES for klass in base.__mro__ if klass is not object for n in vars(klass)}
    return {n for n in names if not n.startswith("_") or n == "__init__" or (n in in_base and not n.startswith("__"))}


def conformance_problems(cls: type, minor: tuple[int, int]) -> list[str]:
    problems = []
    for name in sorted(defined_names(cls)):
        ours = static_attr(cls, name)
        base_class = next((b for b in BASES if hasattr(b, name)), None)
        if base_class is None:
            if name in KVLEDGER_OWN:
                continue
            if name in ADDED_IN and minor < ADDED_IN[name]:
                continue
            problems.append(f"{name}: not a hook of the installed vLLM's connector base (renamed or removed?)")
            continue
        base = static_attr(base_class, name)
        if kind(ours) != kind(base):
            problems.append(f"{name}: a {kind(ours)}, the base's is a {kind(base)}")
        elif kind(ours) in ("method", "classmethod", "staticmethod"):
            problems.extend(signature_problems(name, ours, base))
    return problems


def test_kvledgers_connector_conforms_to_the_installed_vllm():
    assert {"__init__", "get_num_new_matched_tokens", "build_kv_connector_stats"} <= defined_names(KVLedgerConnector)
    assert conformance_problems(KVLedgerConnector, vllm_minor()) == []
    assert not getattr(KVLedgerConnector, "__abstractmethods__", None)


def test_the_checks_cover_the_hooks_a_newer_vllm_adds():
    """On the release that adds a hook, it is the base's and checked like any other."""
    minor = vllm_minor()
    for name, since in ADDED_IN.items():
        assert hasattr(KVConnectorBase_V1, name) == (minor >= since), name


class _Wrong(KVLedgerConnector):
    """Every mistake the check must catch, on top of kvledger's connector."""

    def get_num_new_matched_tokens(self, request, num_tokens):  # a renamed parameter
        raise NotImplementedError

    def update_state_after_alloc(self, request, blocks, num_external_tokens, step):  # an extra required one
        raise NotImplementedError

    def request_finished(self, request):  # a missing one
        raise NotImplementedError

    @staticmethod
    def build_kv_connector_stats(data=None):  # a classmethod in the base
        raise NotImplementedError

    def handle_preemptions(self, *, kv_connector_metadata: KVConnectorMetadata) -> None:  # keyword-only
        raise NotImplementedError

    def wait_for_save_kv(self) -> None:  # a hook vLLM does not call
        raise NotImplementedError


def test_a_wrong_signature_is_caught():
    problems = conformance_problems(_Wrong, vllm_minor())
    assert problems == [
        "build_kv_connector_stats: a staticmethod, the base's is a classmethod",
        "get_num_new_matched_tokens: parameter 2 is 'num_tokens' (positional or keyword), "
        "the base's is 'num_computed_tokens' (positional or keyword)",
        "handle_preemptions: parameter 1 is 'kv_connector_metadata' (keyword-only), "
        "the base's is 'kv_connector_metadata' (positional or keyword)",
        "request_finished: lacks the base's parameter 'block_ids'",
        "update_state_after_alloc: requires 'step', which the base does not pass",
        "wait_for_save_kv: not a hook of the installed vLLM's connector base (renamed or removed?)",
    ]
