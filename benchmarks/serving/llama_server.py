"""llama.cpp's own OpenAI server as the serving benchmark's peer (``bench_serving --client vllm-bench
--peer llamacpp``).

``llama-server`` on the GGUF file, on a free local port, with ``--cont-batching`` and a fixed number of
slots (``-np``), each with its own context: ``-c`` is the whole KV cache, which llama.cpp divides among
the slots (with ``-np`` given its KV cache is not unified), so ``-c`` is slots x context per slot.
``-t`` and ``-tb`` alike: the same threads for decode and for prompt batches. Ready when ``GET /health``
answers 200 (503 while the model loads). Stopped by PID as VllmServer stops vLLM: SIGTERM to its
process group (its own session), SIGKILL to whatever is left after a timeout, so nothing of it remains.

Which binary: ``--llama-server PATH`` or ``$PAGEDSERVE_LLAMA_SERVER`` (read when the arguments are
parsed, not at import). Flags this build does not know, or that a CPU needs, go in ``extra_args``,
after ours: llama.cpp keeps the last value a flag is given, so ``extra_args`` may also override ours
(``-t 8 -tb 8``). ``--no-repack`` is one a CPU needs: here (an AMX CPU, in a container) llama-server
died of SIGILL while loading the model unless told not to repack the weights for its CPU kernels;
``-fa on`` is another a caller may want.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagedserve import cpu_preload
from benchmarks.serving.server_process import log_tail, spawn, stop_group, wait_healthy
from pagedserve.sockets import free_port

BINARY_ENV = "PAGEDSERVE_LLAMA_SERVER"


@dataclass
class LlamaServer:
    """One llama-server: ``with LlamaServer(binary, gguf, num_slots=16) as server: server.base_url``.

    Args:
        binary: the ``llama-server`` executable.
        gguf: the model file it serves.
        threads: its ``-t`` and ``-tb``.
        num_slots: its ``-np``, the sequences it decodes at once.
        ctx_per_slot: tokens of context each slot holds (prompt and output).
        extra_args: more flags, after ours.
        log_file: where its output goes (None: discarded).
    """

    binary: Path
    gguf: Path
    threads: int = 2
    num_slots: int = 16
    ctx_per_slot: int = 2048
    extra_args: tuple[str, ...] = ()
    log_file: Path | None = None
    ready_timeout_s: float = 600.0
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _port: int = 0

    def __post_init__(self) -> None:
        for name in ("threads", "num_slots", "ctx_per_slot"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def port(self) -> int:
        """Where it listens once started (0 before)."""
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def served_model(self) -> str:
        """The first model ``GET /v1/models`` lists (llama.cpp names it by the file's path unless ``--alias``)."""
        models = httpx.get(f"{self.base_url}/v1/models", timeout=30).json()["data"]
        if not models:
            raise RuntimeError(f"llama-server at {self.base_url} lists no model")
        return models[0]["id"]

    def command(self, port: int) -> list[str]:
        """Its command line, listening on 127.0.0.1:``port``."""
        threads = str(self.threads)
        return [str(self.binary), "-m", str(self.gguf), "-t", threads, "-tb", threads,
                "-np", str(self.num_slots), "-c", str(self.num_slots * self.ctx_per_slot), "--cont-batching",
                "--host", "127.0.0.1", "--port", str(port), "--no-webui", *self.extra_args]

    def start(self) -> LlamaServer:
        for path, what in ((self.binary, "llama-server binary"), (self.gguf, "GGUF file")):
            if not Path(path).is_file():
                raise FileNotFoundError(f"no {what} at {path}")
        self._port = free_port()
        # None of our engine's preloads (Intel OpenMP, tcmalloc): llama.cpp links its own runtime.
        env = cpu_preload.strip_env(dict(os.environ))
        self._proc = spawn(self.command(self._port), env, self.log_file)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        def exited(code: int) -> str:
            hint = " (SIGILL: on an AMX CPU try --no-repack)" if code == -signal.SIGILL else ""
            return f"llama-server exited with {code} while starting{hint}" + self._tail()

        if not wait_healthy(self._proc, self.base_url, self.ready_timeout_s, exited):
            self.stop()
            raise TimeoutError(f"llama-server not ready after {self.ready_timeout_s:.0f} s" + self._tail())

    def _tail(self) -> str:
        return log_tail(self.log_file)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM its process group, SIGKILL what is left after ``timeout_s``; returns its exit status."""
        return None if self._proc is None else stop_group(self._proc, timeout_s)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
