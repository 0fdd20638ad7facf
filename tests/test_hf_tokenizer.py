"""pagedserve.hf_tokenizer: the compute service and the gateway load a directory's tokenizer the same
way, and it tokenizes as transformers' AutoTokenizer does (ids, pieces, special tokens, the chat
template), on the default model's files."""

from __future__ import annotations

from transformers import AutoTokenizer

from compute_service.model.model_loader import load_tokenizer, resolve_model
from pagedserve.hf_tokenizer import load_hf_tokenizer

TEXTS = ["What is the capital of France?", "  two spaces, a tab\tand\nnewlines\n\n", "数字 12345 émigré — “quotes” 🙂",
         "def f(x):\n    return x ** 2  # comment", "<|im_start|>user\nhi<|im_end|>", "</s><s> <|endoftext|> a" * 3]


def test_the_loader_tokenizes_as_auto_tokenizer_does() -> None:
    directory = resolve_model("default").path
    ours, auto = load_hf_tokenizer(directory), AutoTokenizer.from_pretrained(directory, local_files_only=True)
    for text in TEXTS:
        for special in (True, False):
            expected = auto(text, add_special_tokens=special)["input_ids"]
            assert ours(text, add_special_tokens=special)["input_ids"] == expected, (text, special)
    ids = list(range(len(auto)))
    assert ours.batch_decode([[i] for i in ids]) == auto.batch_decode([[i] for i in ids])
    assert (ours.all_special_ids, ours.eos_token_id, ours.bos_token_id) == (auto.all_special_ids, auto.eos_token_id,
                                                                            auto.bos_token_id)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == auto.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
    assert type(load_tokenizer(directory)) is type(ours)  # the compute service's own loader is this one
