"""Real processes for the service tests: a memory service and a compute service, started with
``python -m`` through ServiceProcess, talked to over their sockets, stopped by PID.

The model is a tiny random-weight Llama with a byte-level tokenizer (every token is one byte, so
multi-byte characters and stop strings straddle token boundaries all the time). Its EOS token is
the first token that transformers generates greedily for ``EOS_PROMPT`` at an index >= 3 and not
before it, so every stop kind can be reached on purpose.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from pagedserve.compute.v1 import compute_pb2 as cpb
from pagedserve.compute.v1 import compute_pb2_grpc
from pagedserve.memory.v1 import memory_pb2 as mpb
from pagedserve.memory.v1 import memory_pb2_grpc
from pagedserve.process import ServiceProcess

COMPUTE_SERVICE = "pagedserve.compute.v1.Compute"
MEMORY_SERVICE = "pagedserve.memory.v1.MemoryManager"
EOS_PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, "
BLOCK_SIZE = 4


@dataclass(frozen=True)
class ServiceModel:
    path: Path
    hf_model: torch.nn.Module
    tokenizer: object
    eos_token_id: int
    vocab_size: int


def build_byte_tokenizer():
    """A byte-level tokenizer without merges: 256 byte tokens, then <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({"<s>": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return fast


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens, EOS ignored."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                             do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0, eos_token_id=None)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == max_tokens, "transformers stopped early: EOS was not ignored"
    return tokens


def build_service_model(directory: Path) -> ServiceModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=256, eos_token_id=257,
    )
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    generated = hf_greedy(model, EOS_PROMPT, 12)
    eos = next(t for i, t in enumerate(generated) if i >= 3 and t not in generated[:i])
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(directory)
    tokenizer = build_byte_tokenizer()
    tokenizer.save_pretrained(directory)
    return ServiceModel(directory, model, tokenizer, eos, 258)


def start_memory(socket: Path, *extra: str) -> ServiceProcess:
    return ServiceProcess.launch(
        "memory_service", ["--socket", socket, "--block-size", BLOCK_SIZE, "--lease-ttl-s", "2",
                           "--log-level", "warning", *extra],
        address=f"unix:{socket}", health_service=MEMORY_SERVICE, ready_timeout_s=60,
    )


def start_compute(model: Path | str, memory_socket: Path, listen: str, *extra: str,
                  log_file: Path | None = None) -> ServiceProcess:
    return ServiceProcess.launch(
        "compute_service", ["--model", model, "--memory-socket", memory_socket, "--listen", listen,
                            "--block-size", BLOCK_SIZE, "--memory-retry-interval-s", "0.2",
                            "--memory-ping-interval-s", "0.2", "--log-level", "warning",
                            *extra],
        address=listen, health_service=COMPUTE_SERVICE, ready_timeout_s=180, log_file=log_file,
    )


@dataclass
class Services:
    """A running pair and stubs to both."""

    memory: ServiceProcess
    compute: ServiceProcess
    memory_socket: Path
    channel: grpc.Channel
    stub: compute_pb2_grpc.ComputeStub

    def memory_stats(self) -> mpb.StatsResponse:
        with grpc.insecure_channel(f"unix:{self.memory_socket}") as channel:
            return memory_pb2_grpc.MemoryManagerStub(channel).Stats(mpb.StatsRequest(), timeout=10)

    def wait_released(self, timeout_s: float = 3.0) -> mpb.StatsResponse:
        """Memory stats once no sequence holds blocks (a finished or aborted request's blocks go
        back with the engine's next step); fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (stats := self.memory_stats()).num_sequences and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stats.num_sequences == 0, f"{stats.num_sequences} sequences still hold blocks"
        return stats

    def used_blocks(self) -> int:
        return sum(p.num_used_blocks for p in self.memory_stats().pools)

    def generate(self, prompt: list[int], timeout: float = 60, **kwargs) -> list[cpb.GenerateResponse]:
        request_fields = {k: kwargs.pop(k) for k in ("request_id", "priority", "cache_salt") if k in kwargs}
        request = cpb.GenerateRequest(prompt_token_ids=prompt, params=cpb.SamplingParams(**kwargs), **request_fields)
        return list(self.stub.Generate(request, timeout=timeout))


def shm_segments(pid: int) -> list[Path]:
    """The memory service's pool segments (named after its PID)."""
    return sorted(Path("/dev/shm").glob(f"pagedserve-kv-{pid}-*"))


@contextmanager
def running_services(model: Path | str, *, memory_args: tuple[str, ...] = ("--max-num-blocks", "128"),
                     compute_args: tuple[str, ...] = (), compute_log: Path | None = None) -> Iterator[Services]:
    """Start a memory and a compute service in a private directory; stop both by PID and check that
    both exited cleanly and left no socket and no shared-memory segment behind. A test that swaps
    the memory service (kill, restart) stores the new one in ``services.memory``. ``compute_log``
    collects the compute service's output (else it shows with the test's)."""
    with tempfile.TemporaryDirectory(prefix="pscmp-") as directory:
        memory_socket = Path(directory) / "memory.sock"
        listen = f"unix:{directory}/compute.sock"
        memory = start_memory(memory_socket, *memory_args)
        try:
            compute = start_compute(model, memory_socket, listen, *compute_args, log_file=compute_log)
        except BaseException:
            memory.stop()
            raise
        channel = grpc.insecure_channel(listen)
        services = Services(memory, compute, memory_socket, channel, compute_pb2_grpc.ComputeStub(channel))
        try:
            yield services
        finally:
            channel.close()
            compute_status = services.compute.stop()
            memory_status = services.memory.stop()
        assert compute_status == 0 and memory_status == 0
        assert not shm_segments(services.memory.pid)
        assert not Path(directory, "compute.sock").exists()
