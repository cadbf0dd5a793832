"""/v1/embeddings with the real demo model (all-MiniLM-L6-v2, imported by pull-demo), through the official openai
client: vectors checked against a float32 numpy reference computed here from the same safetensors."""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from tests.embedding_reference import reference_embeddings, reference_token_ids
from tests.integration.test_transcription import read_sse

MODEL = "minilm-l6"
PARAPHRASES = ["A man is eating food.", "A man is eating a piece of bread."]
UNRELATED = "The new movie is awesome."


@pytest.fixture(scope="module")
def model_dir(models_dir):
    path = models_dir / MODEL
    if not path.exists():
        pytest.fail(f"demo model missing in {models_dir}: run `make test` or `mlxq models pull-demo` first")
    return path


def vectors(response) -> np.ndarray:
    """The response's vectors in index order (the index is checked, not assumed)."""
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def test_paraphrases_are_closer_than_unrelated_texts_and_match_the_reference(openai_client, model_dir):
    texts = [*PARAPHRASES, UNRELATED]
    response = openai_client.embeddings.create(model=MODEL, input=texts)
    got = vectors(response)
    assert got.shape == (3, 384)
    np.testing.assert_allclose(got, reference_embeddings(model_dir, texts), atol=1e-3)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)
    close, far = float(got[0] @ got[1]), float(got[0] @ got[2])
    assert close > 0.6 and far < 0.2, (close, far)
    assert response.usage.prompt_tokens == sum(len(ids) for ids in reference_token_ids(model_dir, texts))
    assert response.usage.total_tokens == response.usage.prompt_tokens
    assert response.model == MODEL


def test_base64_equals_float(api):
    text = "Vectors are the same whichever way they are written."
    floats = api.post("/v1/embeddings", json={"model": MODEL, "input": text, "encoding_format": "float"})
    encoded = api.post("/v1/embeddings", json={"model": MODEL, "input": text, "encoding_format": "base64"})
    assert floats.status_code == encoded.status_code == 200, (floats.text, encoded.text)
    as_floats = np.array(floats.json()["data"][0]["embedding"], dtype=np.float32)
    raw = encoded.json()["data"][0]["embedding"]
    assert isinstance(raw, str)
    decoded = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    assert decoded.shape == (384,)
    np.testing.assert_allclose(decoded, as_floats, atol=1e-6)


def test_token_ids_embed_as_their_text(openai_client, model_dir):
    text = "Token ids are the model's own."
    [ids] = reference_token_ids(model_dir, [text])
    by_text = vectors(openai_client.embeddings.create(model=MODEL, input=text))
    by_ids = vectors(openai_client.embeddings.create(model=MODEL, input=ids[1:-1]))  # without [CLS] and [SEP]
    many = vectors(openai_client.embeddings.create(model=MODEL, input=[ids[1:-1], ids[1:-1][:3]]))
    np.testing.assert_allclose(by_ids, by_text, atol=1e-5)
    np.testing.assert_allclose(many[:1], by_text, atol=1e-5)


def test_sixteen_requests_at_once_are_each_answered_with_their_own_vectors(openai_client, model_dir):
    batches = [[f"Request {r} asks about topic number {i}, which is {'blue' if i % 2 else 'red'}." for i in range(r % 4 + 1)]
               for r in range(16)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda texts: openai_client.embeddings.create(model=MODEL, input=texts), batches))
    expected = reference_embeddings(model_dir, [t for texts in batches for t in texts])
    start = 0
    for texts, response in zip(batches, answers, strict=True):
        np.testing.assert_allclose(vectors(response), expected[start:start + len(texts)], atol=1e-3)
        start += len(texts)


def test_models_list_an_embedding_model_with_its_length_and_room(api):
    entry = api.get(f"/v1/models/{MODEL}").json()
    assert (entry["kind"], entry["dimensions"], entry["context_length"]) == ("embedding", 384, 256)
    assert entry["sampling_defaults"] == {}


@pytest.mark.parametrize("body, param", [
    ({"input": ["fine"] * 2049}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["fine", ""]}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": {"text": "no"}}, "input"),
    ({"input": [1, -2]}, "input"),
    ({"input": [[5, 6], [7, 30522]]}, "input[1]"),
    ({"input": "fine", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "fine", "dimensions": 128}, "dimensions"),
    ({"input": "fine", "dimensions": 0}, "dimensions"),
])
def test_bad_input_gets_a_400_naming_the_field(api, body, param):
    response = api.post("/v1/embeddings", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_an_input_past_the_models_room_is_refused_naming_it(openai_client):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.embeddings.create(model=MODEL, input=["short", "word " * 300])
    assert info.value.body["param"] == "input[1]"
    assert info.value.body["code"] == "context_length_exceeded"
    assert "256" in info.value.body["message"]


def test_models_of_other_kinds_are_refused_on_each_side(openai_client):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.embeddings.create(model="smollm2-135m", input="hello")
    assert (info.value.body["code"], info.value.body["param"]) == ("invalid_model", "model")
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert (info.value.body["code"], info.value.body["param"]) == ("invalid_model", "model")


def test_an_async_embeddings_job_gives_its_list_and_a_npy_file_of_its_vectors(api, model_dir):
    texts = [f"Document {i} of an async job about {'cats' if i % 2 else 'ships'}." for i in range(40)]
    response = api.post("/v1/jobs/embeddings", json={"model": MODEL, "input": texts, "encoding_format": "base64",
                                                     "metadata": {"batch": "7"}})
    assert response.status_code == 202, response.text
    job = response.json()
    assert read_sse(api, job["links"]["events"])[-1]["event"] == "done"
    listed = api.get(job["links"]["result"]).json()
    assert [d["index"] for d in listed["data"]] == list(range(40)) and isinstance(listed["data"][0]["embedding"], str)
    npy = api.get(job["links"]["result"], params={"format": "npy"})
    assert npy.status_code == 200 and npy.headers["content-type"] == "application/octet-stream"
    array = np.load(io.BytesIO(npy.content))
    assert array.dtype == np.float32 and array.shape == (40, 384)
    np.testing.assert_allclose(array, reference_embeddings(model_dir, texts), atol=1e-3)
    np.testing.assert_array_equal(array[3], np.frombuffer(base64.b64decode(listed["data"][3]["embedding"]), "<f4"))
    record = api.get(job["links"]["self"]).json()
    assert record["kind"] == "embedding" and record["metadata"] == {"batch": "7"} and record["result"]["object"] == "list"
    wrong = api.get(job["links"]["result"], params={"format": "srt"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "format"


def test_the_cli_prints_or_saves_the_vectors_the_api_gives(service, openai_client, model_dir, tmp_path):
    from click.testing import CliRunner

    from mlxq.cli import main

    texts = [*PARAPHRASES, UNRELATED]
    expected = vectors(openai_client.embeddings.create(model=MODEL, input=texts))
    runner = CliRunner()
    printed = runner.invoke(main, ["embed", *texts[:2], "--url", service.base_url])  # its model: the first listed
    assert printed.exit_code == 0, printed.output
    rows = [json.loads(line) for line in printed.output.splitlines()]
    assert [row["index"] for row in rows] == [0, 1]
    np.testing.assert_allclose(np.array([row["embedding"] for row in rows]), expected[:2], atol=1e-6)
    # A file of lines (a blank one skipped) after an argument, saved as .npy.
    lines = tmp_path / "texts.txt"
    lines.write_text(f"{texts[1]}\n\n{texts[2]}\n")
    out = tmp_path / "v.npy"
    saved = runner.invoke(main, ["embed", texts[0], "--file", str(lines), "--model", MODEL, "--out", str(out),
                                 "--url", service.base_url])
    assert saved.exit_code == 0, saved.output
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == (3, 384)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    # Nothing to embed, or a model that is not an embedding model: one line saying so.
    assert "give texts to embed" in runner.invoke(main, ["embed", "--url", service.base_url]).output
    wrong = runner.invoke(main, ["embed", "hi", "--model", "smollm2-135m", "--url", service.base_url])
    assert wrong.exit_code == 1 and "HTTP 400" in wrong.output and "invalid_model" in wrong.output
