"""The OpenAI-compatible server with kvledger: a repeated prompt is restored."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from kvledger.adapters.settings import kv_transfer_config

from .conftest import REPO, replay_summary

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _wait_healthy(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise AssertionError(f"the server was not healthy within {timeout_s} s")


def test_two_identical_completions_the_second_restored(models, tmp_path):
    port = _free_port()
    log = tmp_path / "server-events.log"
    transfer = kv_transfer_config(capacity_bytes=32 << 20, event_log=str(log))
    server_log = (tmp_path / "server.out").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(models["tiny-llama"]),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
         "--block-size", "32", "--enforce-eager", "--no-enable-prefix-caching",
         "--kv-cache-memory-bytes", str(64 << 20), "--enable-prompt-tokens-details",
         "--kv-transfer-config", json.dumps(transfer)],
        cwd=REPO, stdout=server_log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(f"{base}/health", server, timeout_s=240)
        rng = random.Random(5)
        prompt = " ".join(f"w{rng.randrange(1000)}" for _ in range(80))
        body = {"model": str(models["tiny-llama"]), "prompt": prompt, "max_tokens": 8, "temperature": 0}
        first = _post(f"{base}/v1/completions", body)
        second = _post(f"{base}/v1/completions", body)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        server_log.close()
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    cached = [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in (first, second)]
    assert cached == [0, 64]  # 80 prompt tokens: two whole 32-token blocks restored
    summary = replay_summary(log)
    assert summary["stats"]["loads"] == 1
    assert summary["stats"]["hit_tokens"] == 64
