"""``/v1/embeddings`` with the official ``openai`` SDK: both encodings (the SDK
asks for base64 unless told otherwise), texts and token ids, equal to transformers' pooled final
hidden states of the e2e model, usage counted, bad input a 400 naming the field, a list whose answer
cannot fit a 400 before any work, the client's x-request-id; a gateway with ``--embedding-pooling
mean``; and an input the backend dropped an error, never an empty vector."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from gateway.core.types import Completion, Reply, Usage
from gateway.openai_api.embeddings_api import check_embeddings
from pagedserve.errors import UnavailableError
from pagedserve.process import wait_until
from pagedserve_testing.tiny_model import ServiceModel
from tests.e2e.conftest import Engine, Http, start_http

TEXTS = ["Hello, world", "a much longer second input, to be pooled"]


def _reference(service_model: ServiceModel, token_ids: list[int], pooling: str) -> np.ndarray:
    with torch.no_grad():
        hidden = service_model.hf_model.model(torch.tensor([token_ids])).last_hidden_state[0].float()
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return (pooled / pooled.norm()).numpy()


def _tokens(http: Http, text: str) -> list[int]:
    return httpx.post(f"{http.base_url}/tokenize", json={"prompt": text}, timeout=10).json()["tokens"]


def test_embeddings_of_texts_and_ids_in_both_encodings(http: Http, service_model: ServiceModel) -> None:
    client = http.client()
    floats = client.embeddings.create(model=http.model, input=TEXTS, encoding_format="float")
    default = client.embeddings.create(model=http.model, input=TEXTS)  # the SDK asks for base64, decodes it
    token_ids = [_tokens(http, text) for text in TEXTS]
    by_ids = client.embeddings.create(model=http.model, input=token_ids, encoding_format="float")
    hidden_size = service_model.hf_model.config.hidden_size
    assert [d.index for d in floats.data] == [0, 1] and floats.model == http.model
    for i, ids in enumerate(token_ids):
        vector = np.array(floats.data[i].embedding)
        assert vector.shape == (hidden_size,) and np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
        np.testing.assert_allclose(vector, _reference(service_model, ids, "last"), atol=1e-4)
        np.testing.assert_allclose(np.array(default.data[i].embedding), vector, atol=1e-6)
        np.testing.assert_allclose(np.array(by_ids.data[i].embedding), vector, atol=1e-6)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, token_ids))
    raw = httpx.post(f"{http.base_url}/v1/embeddings", json={"input": "x", "encoding_format": "base64"},
                     timeout=30).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.shape == (hidden_size,) and raw["usage"]["prompt_tokens"] == len(_tokens(http, "x"))
    assert '"method": "OpenAI.Embeddings"' in http.gateway.log_file.read_text()


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[1, 10**9]]}, "input"),
    ({"input": 5}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["a", 1]}, "input"),
    ({"input": "x", "priority": "high"}, "priority"),
    ({}, "input"),
])
def test_bad_input_is_a_400_naming_it(http: Http, body: dict, param: str) -> None:
    reply = httpx.post(f"{http.base_url}/v1/embeddings", json=body, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_unknown_model_is_a_404(http: Http) -> None:
    with pytest.raises(openai.NotFoundError):
        http.client().embeddings.create(model="nope", input="x")


def test_mean_pooling_by_flag(engines: list[Engine], run_dir: Path, service_model: ServiceModel) -> None:
    mean = start_http(engines, run_dir, "--embedding-pooling", "mean")
    try:
        wait_until(lambda: mean.gateway.num_healthy_backends() == 1, what="the backend in rotation")
        reply = mean.client().embeddings.create(model=mean.model, input=TEXTS[1], encoding_format="float")
        want = _reference(service_model, _tokens(mean, TEXTS[1]), "mean")
        np.testing.assert_allclose(np.array(reply.data[0].embedding), want, atol=1e-4)
    finally:
        assert mean.gateway.stop() == 0


def test_an_answer_past_the_cap_is_refused_before_any_work(engines: list[Engine], run_dir: Path) -> None:
    # 64 floats an embedding (the e2e model): ~1,536 bytes as JSON, so 2,730 fit in the 4 MiB cap.
    # At the wire's 4 bytes a float, 2,800 were let through, run, and answered in a ~4.3 MB body.
    big = start_http(engines, run_dir, "--max-prompts-per-request", "4000")
    try:
        wait_until(lambda: big.gateway.num_healthy_backends() == 1, what="the backend in rotation")
        body = {"input": ["x"] * 2800, "encoding_format": "float"}
        reply = httpx.post(f"{big.base_url}/v1/embeddings", json=body, timeout=60,
                           headers={"x-request-id": "rid-emb-refused"})
        assert reply.status_code == 400, reply.text[:300]
        error = reply.json()["error"]
        assert error["param"] == "input" and "at most 2730 inputs" in error["message"], error
        assert "rid-emb-refused" not in big.gateway.log_file.read_text()  # nothing ran
        ok = httpx.post(f"{big.base_url}/v1/embeddings", json={"input": ["x", "y"]}, timeout=30,
                        headers={"x-request-id": "rid-emb"})
        assert ok.status_code == 200 and len(ok.json()["data"]) == 2
        assert '"request_id": "rid-emb-1"' in big.gateway.log_file.read_text()  # the client's id, per input
    finally:
        assert big.gateway.stop() == 0


def test_an_input_without_its_embedding_is_an_error() -> None:
    whole = Reply("embd-0", [Completion(0, finish_reason="length")], Usage(prompt_tokens=2), embedding=[1.0])
    dropped = Reply("embd-1", [Completion(0, finish_reason="abort")], Usage(prompt_tokens=2))
    check_embeddings([whole])
    with pytest.raises(UnavailableError, match=r"^input\[1\]: .*abort"):
        check_embeddings([whole, dropped])  # was a 200 with "embedding": []
