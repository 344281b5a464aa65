"""Start a real ``moerl serve`` process on loopback for the engine tests."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from moerl.megatron.parallel import free_port


@contextmanager
def running_server(model_dir: Path, log_path: Path, *extra: str):
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moerl.cli", "serve", "--model", str(model_dir), "--port", str(port), *extra],
            stdout=log, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moerl serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moerl serve did not come up:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
