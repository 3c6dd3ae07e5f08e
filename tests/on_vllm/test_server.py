"""The OpenAI-compatible server with kvledger: a repeated prompt is restored."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest

from kvledger.adapters.settings import kv_transfer_config

from .conftest import Zygote, replay_summary, zygote

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _wait_healthy(url: str, server: Zygote, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited with {server.poll()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise AssertionError(f"the server was not healthy within {timeout_s} s")


def test_two_identical_completions_the_second_restored(models, tmp_path):
    """The server runs as `python -m vllm.entrypoints.openai.api_server` would,
    forked from the zygote (its engine core from the forkserver)."""
    port = _free_port()
    log = tmp_path / "server-events.log"
    transfer = kv_transfer_config(capacity_bytes=32 << 20, event_log=str(log), miss_metrics=True)
    argv = ["--model", str(models["tiny-llama"]), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "512", "--block-size", "32", "--enforce-eager", "--no-enable-prefix-caching",
            "--kv-cache-memory-bytes", str(64 << 20), "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(transfer)]
    server = zygote()
    pid = server.start({"module": "vllm.entrypoints.openai.api_server", "argv": argv, "multiprocess": True},
                       tmp_path / "server.out")
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(f"{base}/health", server, timeout_s=240)
        rng = random.Random(5)
        prompt = " ".join(f"w{rng.randrange(1000)}" for _ in range(80))
        body = {"model": str(models["tiny-llama"]), "prompt": prompt, "max_tokens": 8, "temperature": 0}
        first = _post(f"{base}/v1/completions", body)
        second = _post(f"{base}/v1/completions", body)
        metrics = _metrics_once_loaded(f"{base}/metrics", missed_tokens=80 + 16)
    finally:
        os.kill(pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)
            server.wait(timeout=30)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    cached = [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in (first, second)]
    assert cached == [0, 64]  # 80 prompt tokens: two whole 32-token blocks restored
    summary = replay_summary(log)
    assert summary["stats"]["loads"] == 1
    assert summary["stats"]["hit_tokens"] == 64
    # The connector's metrics on the server's /metrics agree with the log.
    page_bytes = metrics["vllm:kv_offload_load_bytes_total"] / 2  # the load moved two blocks
    assert page_bytes > 0 and page_bytes == int(page_bytes)
    assert metrics["vllm:kv_offload_store_bytes_total"] == summary["stats"]["keys_stored"] * page_bytes
    assert metrics["vllm:kv_offload_load_time_total"] > 0
    assert metrics["vllm:kv_offload_store_size_count"] == summary["stats"]["stores"]
    assert metrics["vllm:kvledger_hit_tokens_total"] == 64
    assert metrics["vllm:kvledger_loads_total"] == 1
    assert metrics["vllm:kvledger_tier_used_blocks"] == summary["tier"]["used_slots"]
    assert metrics["vllm:kvledger_tier_capacity_blocks"] == summary["tier"]["capacity_slots"]
    assert metrics["vllm:kvledger_load_failures_total"] == 0
    # The live count of missed tokens by cause is explain's count over the log: the first request's
    # two blocks were new, and each request computed its last, partial block.
    explained = _explain(log)
    missed = {name.split("|")[1]: value for name, value in metrics.items() if name.startswith(MISSED + "|")}
    assert missed == {cause: entry["tokens"] for cause, entry in explained["missed_by_cause"].items()}
    assert missed == {"first_seen": 64, "partial_block": 32}
    # The restore's stages, each observed once (a host-tier restore: no promotion).
    stages = {name.split("|")[1]: value for name, value in metrics.items()
              if name.startswith("vllm:kvledger_restore_stage_seconds_count|")}
    assert stages == {"lookup": 1, "admission": 1, "load_host": 1, "first_step": 1}


MISSED = "vllm:kvledger_missed_tokens_total"


def _explain(log) -> dict:
    import contextlib
    import io

    from kvledger.adapters.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["explain", str(log), "--json"]) == 0
    return json.loads(out.getvalue())


def _metrics_once_loaded(url: str, timeout_s: float = 30, missed_tokens: int = 0) -> dict[str, float]:
    """kvledger's samples from /metrics, once the load's stats and `missed_tokens`
    arrived (stats reach the front end with the steps after the response; the
    miss counter's, a step or so after its admission's end). A sample labelled
    `cause` is named `name|cause`."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line.startswith(("vllm:kv_offload_", "vllm:kvledger_")):
                name_labels, value = line.rsplit(" ", 1)
                name = name_labels.split("{")[0]
                for label in ('cause="', 'stage="'):
                    if label in name_labels:
                        name += "|" + name_labels.split(label)[1].split('"')[0]
                samples[name] = float(value)
        missed = sum(value for name, value in samples.items() if name.startswith(MISSED + "|"))
        loaded = samples.get("vllm:kv_offload_load_bytes_total")
        if (loaded and missed >= missed_tokens) or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)
