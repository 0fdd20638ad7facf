"""``LLM``: the in-process engine, the way vLLM users call theirs (tests, benchmarks, notebooks)."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from memory_service.api import BlockManagerStats, KvLayout, MemoryClient
from pagedserve.dtypes import dtype_name
from pagedserve.log import get_logger
from pagedserve.process import ServiceProcess

from compute_service.engine.config import EngineConfig
from compute_service.engine.engine import Engine
from compute_service.model.model_loader import load_model
from compute_service.engine.outputs import RequestOutput, collect
from compute_service.engine.sampling_params import SamplingParams

log = get_logger("llm")


class MemoryServiceProcess:
    """A private ``python -m memory_service`` child on a socket in a fresh 0700 directory.

    Leaves nothing behind: a start that fails (or is interrupted, KeyboardInterrupt included)
    stops the child and removes the directory before raising, and the child gets SIGTERM when
    this process dies, even by SIGKILL (ServiceProcess passes ``--parent-pid``).
    """

    def __init__(self, config: EngineConfig, device: str) -> None:
        self.directory = tempfile.mkdtemp(prefix="pagedserve-")
        self.socket = os.path.join(self.directory, "memory.sock")
        args = ["--socket", self.socket, "--device", device,
                "--block-size", str(config.block_size),
                "--enable-prefix-caching", str(config.enable_prefix_caching).lower(),
                "--memory-utilization-threshold", str(config.memory_utilization_threshold),
                "--reserved-fraction", str(config.reserved_fraction),
                "--reserved-min-priority", str(config.reserved_min_priority), "--log-level", "warning"]
        if config.max_num_blocks is not None:
            args += ["--max-num-blocks", str(config.max_num_blocks)]
        # Without a size the memory service picks one (on CPU the least of a cap, a quarter of
        # available RAM and 90% of free /dev/shm) and logs it.
        if config.kv_cache_bytes is not None and config.max_num_blocks is None:
            args += ["--kv-cache-bytes", str(config.kv_cache_bytes)]
        try:
            # Its output goes to a log beside the socket (quoted when the start fails), not to the
            # owner's stdout.
            self.process = ServiceProcess.launch("memory_service", args, address=f"unix:{self.socket}",
                                                 ready_timeout_s=60,
                                                 log_file=os.path.join(self.directory, "memory_service.log"))
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def close(self) -> None:
        self.process.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class LLM:
    """Load a model, attach (or start) a memory service, and generate.

    Args:
        model: "default" (SmolLM2-135M-Instruct) or a local Hugging Face Llama-family directory.
        cache_dir: where converted models are cached (default ``~/.cache/pagedserve``).
        **engine_config: fields of EngineConfig (``max_num_seqs``, ``max_num_batched_tokens``,
            ``block_size``, ``enable_prefix_caching``, ``kv_cache_bytes``, ``max_num_blocks``,
            ``memory_socket`` to attach to a running memory service, ``device``, ``dtype``, ...).
    """

    def __init__(self, model: str = "default", *, cache_dir: str | Path | None = None, **engine_config: Any) -> None:
        self.config = EngineConfig(**engine_config)
        device = self.config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._memory_process: MemoryServiceProcess | None = None
        self._memory: MemoryClient | None = None
        loaded = load_model(model, cache_dir=Path(cache_dir) if cache_dir else None, device=device, dtype=self.config.dtype)
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
                self._memory_process = MemoryServiceProcess(self.config, "cpu" if device == "cpu" else str(loaded.model.device))
                socket = self._memory_process.socket
            self._memory = MemoryClient(f"unix:{socket}", layout, client_name="llm")
            self.engine = Engine(loaded.model, loaded.config, loaded.tokenizer, self._memory, self.config)
            # The pool's size, whoever chose it (a private memory service without a size picks its default).
            log.info("kv_pool", num_blocks=self._memory.num_blocks,
                     num_bytes=self._memory.num_blocks * layout.bytes_per_block)
        except BaseException:
            self.close()
            raise
        self._ids = itertools.count()

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
