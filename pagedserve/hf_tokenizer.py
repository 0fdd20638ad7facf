"""One way to load a model directory's tokenizer, for the compute service and the gateway alike.

With a ``tokenizer.json`` it is ``transformers``' generic fast class over that file: both services
then tokenize with the very same object, and it is the lighter one. ``AutoTokenizer`` picks a
model's own class instead (Qwen2's, for one), which in transformers 5 builds its pipeline again from
the vocabulary and merges and keeps them as Python objects: 104 MiB resident for Qwen2.5's 152k
vocabulary against 55 MiB, for the same ids, pieces and chat template (checked on Qwen2.5 and
SmolLM2; tests/test_hf_tokenizer.py keeps the default model's in step). A model that ships only a slow
tokenizer (``tokenizer.model``) still goes through ``AutoTokenizer``. Where a model's own class
would tokenize differently (a Llama ``tokenizer_config.json`` whose ``add_bos_token`` contradicts its
``tokenizer.json``), the gateway already tokenized with this class; now the compute service agrees
with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_hf_tokenizer(directory: Path) -> Any:
    """The tokenizer (and chat template) of a local directory; transformers' errors pass through."""
    if (directory / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast  # needs no torch

        return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    from transformers import AutoTokenizer  # tokenization code only, no modeling code

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
