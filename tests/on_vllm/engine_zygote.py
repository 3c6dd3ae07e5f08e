"""A process that has imported vLLM once and forks a fresh engine process per
run: each run still starts from a process no other run touched, without
paying the seconds of importing torch and vLLM again.

Protocol, one JSON line each way per run, on stdin and stdout:
  in:  {"spec": {...}, "env": {...}, "stdout": PATH, "stderr": PATH or null (into stdout's)}
  out: {"pid": N}, once forked; then {"status": S}, its exit status (0 ok,
       negative: killed by that signal).
The run gets the test's environment as it is at the run (a test may have set a
variable since the zygote started; PYTHONHASHSEED is the zygote's, which is why
there is one per seed), and its output goes to the two files. The zygote is single-threaded
when it forks (it says so on start, or exits), which is what makes fork safe.
A run that starts vLLM processes of its own (multiprocess, tensor-parallel)
gets them from a forkserver the zygote starts before forking it (`spawn_server.py`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import threading
import traceback

# What an engine's start imports lazily in vLLM 0.32. Only a head start: a
# module another vLLM version lacks, or cannot import without a dependency its
# engine start never needs (0.33's quantization package wants compressed_tensors),
# is left for the run to import if it needs it.
LAZY_MODULES = (
    "vllm.model_executor.layers.quantization.online.base",
    "vllm.v1.sample.ops.penalties",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.worker.gpu_worker",
)


def preload() -> None:
    """torch, vLLM and what an engine's start imports lazily (the CPU worker and
    its model runner), and the connector module vLLM loads by path."""
    import importlib

    import torch  # noqa: F401
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    import kvledger.adapters.vllm  # noqa: F401

    for name in LAZY_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            print(f"engine zygote: {name} not preloaded ({exc})", file=sys.stderr, flush=True)


def run_child(request: dict) -> None:
    """In the forked process: output to the run's files, then the run. Never returns."""
    status = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            if path is None:  # stderr into stdout's file
                os.dup2(1, fd)
                continue
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        os.setpgid(0, 0)  # its own group: a timed-out run is killed with every process it started
        os.environ.clear()
        os.environ.update(request["env"])
        import engine_run
        import spawn_server

        spawn_server.install()

        engine_run.main(request["spec"])
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def main() -> None:
    preload()
    import spawn_server

    # What the zygote holds now, out of every later collection: vLLM collects five times while an engine
    # starts, and each traversed the whole imported heap in the forked run (2.2 of an engine's 3.7 s).
    gc.collect()
    gc.freeze()
    if threading.active_count() != 1:
        names = ", ".join(t.name for t in threading.enumerate())
        print(json.dumps({"error": f"threads after preload ({names}): forking would not be safe"}), flush=True)
        sys.exit(1)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if spawn_server.needed(request["spec"]):  # started here, where no thread runs, and once
            spawn_server.start()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            run_child(request)
        with contextlib.suppress(OSError):  # (a child that already ended)
            os.setpgid(pid, pid)  # as the child does: whichever runs first, the group exists once pid is sent
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"status": code}), flush=True)
    # No interpreter teardown: finalising torch and vLLM took 3.5 s per zygote (7.4 s for a worker's
    # two) at the end of every run, and no state here needs it (the forkserver ends with its last client).
    os._exit(0)


if __name__ == "__main__":
    main()
