"""The bench scripts the suite runs in short form (`bench/soak.py`, `bench/fleet_soak.py`), loaded
from their files, with their vLLM servers forked from the suite's zygotes instead of started (the
zygote's import of vLLM is most of a start)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

from tests.support.zygotes import zygote

REPO = Path(__file__).resolve().parents[2]


def bench_module(name: str) -> ModuleType:
    """`bench/NAME.py`, loaded as a module of its own."""
    spec = importlib.util.spec_from_file_location(f"kvledger_bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ForkedServer:
    """vLLM's API server (`module`, with `args`) forked from the zygote of `hash_seed`, with the
    test's environment as it is now: the interface of the Popen a bench script would start."""

    def __init__(self, module: str, args: list[str], log: Path, hash_seed: str | None = None) -> None:
        self._zygote = zygote(hash_seed)
        self.pid = self._zygote.start({"module": module, "argv": args, "multiprocess": True}, log)

    def poll(self) -> int | None:
        return self._zygote.poll()

    def wait(self, timeout: float) -> int:
        try:
            return self._zygote.wait(timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired("vLLM's API server", timeout) from None
