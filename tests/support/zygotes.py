"""Processes that imported vLLM once and fork a fresh one per run
(`tests/on_vllm/engine_zygote.py`), one per `PYTHONHASHSEED` a test asks for:
the import is most of an engine's start. Shared by every test that needs a
vLLM process, so a pytest worker starts each seed's zygote once."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ON_VLLM = REPO / "tests" / "on_vllm"


def seed_env(hash_seed: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    return env


class Zygote:
    """One `engine_zygote.py` process: forks a run at a time."""

    def __init__(self, hash_seed: str | None) -> None:
        self.process = subprocess.Popen([sys.executable, str(ON_VLLM / "engine_zygote.py")], cwd=REPO,
                                        env=seed_env(hash_seed), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        self.pending = b""
        self.status: int | None = None
        started = self._read(180)
        if "ready" not in started:
            raise RuntimeError(f"the engine zygote did not start: {started}")

    def _read(self, timeout: float) -> dict:
        """The zygote's next line, read from the pipe unbuffered so that poll sees every byte."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        waiting = select.poll()  # not select(): the suite's processes may hold descriptors past FD_SETSIZE
        waiting.register(fd, select.POLLIN)
        while b"\n" not in self.pending:
            if not waiting.poll(timeout * 1000):
                raise TimeoutError
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the engine zygote exited ({self.process.wait()})")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def start(self, spec: dict, stdout: Path, stderr: Path | None = None) -> int:
        """Fork a run of `spec`, its output to `stdout` (and `stderr`, or the same
        file); its pid, also its process group's id."""
        assert self.process.stdin is not None
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        request = {"spec": spec, "env": env, "stdout": str(stdout), "stderr": str(stderr) if stderr else None}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        self.status = None
        return self._read(30)["pid"]

    def poll(self) -> int | None:
        """The run's exit status once it has ended, else None."""
        if self.status is None:
            try:
                self.status = self._read(0)["status"]
            except TimeoutError:
                pass
        return self.status

    def wait(self, timeout: float) -> int:
        if self.status is None:
            self.status = self._read(timeout)["status"]
        return self.status

    def run(self, spec: dict, timeout: float) -> tuple[int, str, str]:
        """The run's exit status, stdout and stderr."""
        with tempfile.TemporaryDirectory(prefix="kvledger-run-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            pid = self.start(spec, out, err)
            try:
                status = self.wait(timeout)
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)
                self.wait(30)
                raise AssertionError(f"vLLM run timed out after {timeout} s:\n{_tail(out, err)}") from None
            return status, out.read_text(errors="replace"), err.read_text(errors="replace")

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


_ZYGOTES: dict[str | None, Zygote] = {}


def _tail(out: Path, err: Path) -> str:
    text = "".join(p.read_text(errors="replace") for p in (out, err) if p.exists())
    return "\n".join(text.splitlines()[-60:])


def close_all() -> None:
    for one in _ZYGOTES.values():  # every one told first, then each waited for
        if one.process.stdin is not None:
            one.process.stdin.close()
    for one in _ZYGOTES.values():
        one.close()
    _ZYGOTES.clear()


def zygote(hash_seed: str | None = None) -> Zygote:
    """The zygote that forks runs under this `PYTHONHASHSEED` (None: a random one)."""
    if hash_seed not in _ZYGOTES:
        _ZYGOTES[hash_seed] = Zygote(hash_seed)
    return _ZYGOTES[hash_seed]


OTHER_SEED = "4242"  # the on-vLLM tests' second seed: its zygote is usually started already


def run_under_another_seed(module: str, timeout: float = 300) -> str:
    """The last line `python -m MODULE` prints in a process forked from the
    zygote of a PYTHONHASHSEED other than this process's."""
    seed = OTHER_SEED if os.environ.get("PYTHONHASHSEED") != OTHER_SEED else "0"
    status, out, err = zygote(seed).run({"module": module, "argv": []}, timeout)
    if status != 0 or not out.strip():
        raise AssertionError(f"python -m {module} under PYTHONHASHSEED={seed} failed (exit {status}):\n{err[-4000:]}")
    return out.strip().splitlines()[-1]
