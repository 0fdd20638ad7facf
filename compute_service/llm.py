"""``LLM``: the in-process engine, the way vLLM users call theirs (tests, benchmarks, notebooks)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
import shutil
import tempfile
import weakref
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from memory_service.api import BlockManagerStats, KvLayout, MemoryClient
from memory_service.config import POOL_FIELDS, MemoryServiceConfig
from pagedserve.config import write_config_file
from pagedserve.dtypes import dtype_name
from pagedserve.log import get_logger
from pagedserve.service_auth import MEMORY_TOKEN_ENV, load_token
from pagedserve.stack import memory_process, ready

from compute_service.engine.config import EngineConfig
from compute_service.engine.engine import Engine
from compute_service.model.model_loader import load_model
from compute_service.engine.outputs import RequestOutput, collect
from compute_service.engine.sampling_params import SamplingParams

log = get_logger("llm")


class MemoryServiceProcess:
    """A private ``python -m memory_service`` child on a socket in a fresh 0700 directory, started
    with the whole ``config`` (written beside the socket and passed as ``--config``) and, unless the
    config names one, a fresh token in a 0600 file beside it (``config.auth_token`` is it): only the
    owner's client is trusted (memory_service/service/trust.py).

    Leaves nothing behind: a start that fails (or is interrupted, KeyboardInterrupt included)
    stops the child and removes the directory before raising; without ``close`` both go when the
    object is collected or the interpreter exits; and the child gets SIGTERM when this process
    dies, even by SIGKILL (pagedserve.stack's ServiceProcess passes ``--parent-pid``).
    """

    def __init__(self, config: MemoryServiceConfig) -> None:
        self.directory = tempfile.mkdtemp(prefix="pagedserve-")
        self.socket = os.path.join(self.directory, "memory.sock")
        try:
            if config.auth_token is None:
                token_file = os.path.join(self.directory, "memory.token")
                with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                    f.write(secrets.token_urlsafe(32))
                config = dataclasses.replace(config, auth_token_file=token_file)
            self.config = dataclasses.replace(config, socket=self.socket)
            config_file = write_config_file(self.config, os.path.join(self.directory, "memory_service.json"))
            # Its output goes to a log beside the socket (quoted when the start fails), not to the
            # owner's stdout.
            self.process = ready(memory_process(self.socket, ["--config", config_file],
                                                log_file=os.path.join(self.directory, "memory_service.log")), 60)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        # An owner that never calls close (a script that just ends, an LLM dropped) still stops
        # the child and removes the directory: when this object is collected, or at exit.
        self._finalizer = weakref.finalize(self, _stop_and_remove, self.process, self.directory)

    def close(self) -> None:
        self._finalizer()  # once: later calls do nothing


def _stop_and_remove(process: Any, directory: str) -> None:
    process.stop()
    shutil.rmtree(directory, ignore_errors=True)


def split_config(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``LLM``'s keywords as (EngineConfig fields, the pool's MemoryServiceConfig fields)."""
    pool = {k: config[k] for k in POOL_FIELDS if k in config}
    return {k: v for k, v in config.items() if k not in pool}, pool


class LLM:
    """Load a model, attach (or start) a memory service, and generate.

    Args:
        model: "default" (SmolLM2-135M-Instruct), a local Hugging Face Llama-family directory or a GGUF
            file (llama, qwen2; its quantized blocks kept as they are on a CPU that computes on them, see
            ``quantization``; the conversion cached by the file's sha256).
        cache_dir: where converted models are cached (default ``~/.cache/pagedserve``).
        memory: the whole config of the private memory service (its ``block_size`` and ``device``
            are the engine's); default: the memory service's defaults (without a size it sizes the
            pool itself and logs it: memory_service/config.py), warnings-only logs.
        memory_token_file: the token of the memory service at ``memory_socket`` (else
            ``$PAGEDSERVE_MEMORY_TOKEN``); a private memory service gets a fresh one.
        **config: fields of EngineConfig (``max_num_seqs``, ``max_num_batched_tokens``,
            ``block_size``, ``memory_socket`` to attach to a running memory service, ``device``,
            ``dtype``, ``quantization``, ...) and the pool's fields of MemoryServiceConfig (``kv_cache_bytes``,
            ``max_num_blocks``, ``enable_prefix_caching``, ... : ``POOL_FIELDS``) for the private
            memory service.
    """

    def __init__(self, model: str = "default", *, cache_dir: str | Path | None = None,
                 memory: MemoryServiceConfig | None = None, memory_token_file: str | None = None,
                 **config: Any) -> None:
        engine_fields, pool_fields = split_config(config)
        self.config = EngineConfig(**engine_fields)
        if self.config.memory_socket is not None and (pool_fields or memory is not None):
            raise ValueError(f"pool settings {sorted(pool_fields) or ['memory']} belong to the memory service at "
                             f"{self.config.memory_socket!r}: give them to it, not to LLM")
        device = self.config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._memory_process: MemoryServiceProcess | None = None
        self._memory: MemoryClient | None = None
        loaded = load_model(model, cache_dir=Path(cache_dir) if cache_dir else None, device=device,
                            dtype=self.config.dtype, quantization=self.config.quantization)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        layout = KvLayout(
            num_layers=loaded.config.num_layers,
            num_kv_heads=loaded.config.num_kv_heads,
            head_dim=loaded.config.head_dim,
            dtype=dtype_name(loaded.model.dtype),
            block_size=self.config.block_size,
        )
        try:
            socket = self.config.memory_socket
            if socket is None:
                pool_device = "cpu" if device == "cpu" else str(loaded.model.device)
                self._memory_process = MemoryServiceProcess(self._memory_config(memory, pool_fields, pool_device))
                socket, token = self._memory_process.socket, self._memory_process.config.auth_token
            else:
                token = load_token(memory_token_file, "memory_token_file", env=MEMORY_TOKEN_ENV)
            self._memory = MemoryClient(f"unix:{socket}", layout, client_name="llm", token=token,
                                        model_fingerprint=loaded.fingerprint)
            self.engine = Engine(loaded.model, loaded.config, loaded.tokenizer, self._memory, self.config)
            # The pool's size, whoever chose it (a private memory service without a size picks its default).
            log.info("kv_pool", num_blocks=self._memory.num_blocks,
                     num_bytes=self._memory.num_blocks * layout.bytes_per_block)
        except BaseException:
            self.close()
            raise
        self._ids = itertools.count()

    def _memory_config(self, memory: MemoryServiceConfig | None, pool_fields: dict[str, Any],
                       device: str) -> MemoryServiceConfig:
        """The private memory service's config: the engine's layout and device. No default size: without
        ``kv_cache_bytes`` or ``max_num_blocks`` the service sizes the pool (on CPU the least of a cap,
        a quarter of available RAM and 90% of free /dev/shm) and logs it."""
        if memory is None:
            memory = MemoryServiceConfig(log_level="warning", **pool_fields)
        elif pool_fields:
            raise ValueError(f"give the pool settings {sorted(pool_fields)} in memory=, not beside it")
        return dataclasses.replace(memory, block_size=self.config.block_size, device=device)

    def _tokenize(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token id lists")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: str | Seq[int] | Seq[str | Seq[int]],
        sampling_params: SamplingParams | None = None,
        *,
        priority: int | Seq[int] = 0,
        cache_salt: str = "",
        **params: Any,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in order.

        Args:
            prompts: a string, a token-id list, or a list of either.
            sampling_params: a SamplingParams; or give its fields as keywords (``max_tokens=``,
                ``temperature=``, ``top_p=``, ``seed=``, ``stop=``, ``ignore_eos=``, ...).
            priority: one for all prompts, or one per prompt.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None:
            sampling_params = SamplingParams(**params)
        elif params:
            raise ValueError("give either sampling_params or keyword sampling fields, not both")
        priorities = [priority] * len(prompts) if isinstance(priority, int) else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        for request_id, prompt, prio in zip(ids, prompts, priorities):
            self.engine.add_request(request_id, self._tokenize(prompt), sampling_params, priority=prio,
                                    cache_salt=cache_salt)
        results: dict[str, RequestOutput] = {}
        num_finished = 0
        while num_finished < len(ids):
            num_finished += len(collect(results, self.engine.step()))  # each step's news, accumulated
        if not self.engine.requests:
            self.engine.step()  # frees the last finished sequences' blocks now, not at the next call
        return [results[i] for i in ids]

    def chat(self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None,
             **kwargs: Any) -> RequestOutput:
        """One chat conversation through the model's chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return self.generate([list(ids)], sampling_params, **kwargs)[0]

    def memory_stats(self) -> BlockManagerStats:
        """The memory service's statistics (blocks per pool, utilisation, prefix-cache hits, ...)."""
        return self._memory.stats()

    def close(self) -> None:
        """Detach from the memory service and stop it if this LLM started it."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()  # its grammar compile workers
        if self._memory is not None:
            self._memory.close()
            self._memory = None
        if self._memory_process is not None:
            self._memory_process.close()
            self._memory_process = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
