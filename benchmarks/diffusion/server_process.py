"""A `vllm serve` subprocess for `load_benchmark.py` and `lora_serving_benchmark.py`: start, wait for
/health, read /metrics, stop. It shares the caller's process group (`timeout` reaches it) and logs to a
file; with `on_sigterm` installed SIGTERM raises `Interrupted`, so a harness stops its server and keeps
what it measured."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.diffusion.common import ratio

REPO_ROOT = Path(__file__).resolve().parents[2]


class Interrupted(BaseException):
    """SIGTERM arrived: stop the server, keep the results so far (not an Exception: nothing that
    catches a failed request may swallow it)."""


def on_sigterm(signum, frame):
    raise Interrupted("SIGTERM")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One `serve` subprocess (same process group, so `timeout` reaches it too), logging to a file."""

    def __init__(self, cmd: list[str], port: int, log_path: Path):
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_ready(self, timeout_s: float) -> None:
        """Poll /health; RuntimeError (with the log tail) if the server exits or is not up in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def metrics_text(self) -> str:
        """The /metrics exposition text; "" on failure (metrics are diagnostics: never fail a run)."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
                return response.read().decode()
        except Exception:
            return ""

    def metrics(self) -> dict[str, float]:
        """/metrics samples summed over labels, plus `steps_total[path]` per path; {} on failure."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self.metrics_text()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
                if s.name.endswith("steps_total") and "path" in s.labels:
                    out[f"steps_total[{s.labels['path']}]"] = s.value
        return out

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def engine_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the engine did during one scenario, from two /metrics snapshots."""
    if not before or not after:
        return {}

    def delta(name: str) -> float:
        return after.get(f"vllm_omni:{name}", 0.0) - before.get(f"vllm_omni:{name}", 0.0)

    paths = {k[12:-1]: after[k] - before.get(k, 0.0) for k in after if k.startswith("steps_total[")}
    return {
        "num_steps": delta("steps_total"),
        "steps_by_path": {p: n for p, n in paths.items() if n},
        "num_mixed_resolution_steps": delta("mixed_resolution_steps_total"),
        "num_request_steps": delta("step_num_requests_sum"),
        "mean_reqs_per_step": ratio(delta("step_num_requests_sum"), delta("step_num_requests_count")),
        "mean_tokens_per_step": ratio(delta("step_num_tokens_sum"), delta("step_num_tokens_count")),
        "busy_s": delta("step_latency_seconds_sum"),
    }
