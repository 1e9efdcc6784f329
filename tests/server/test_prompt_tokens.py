"""A completion's text prompt is encoded as the model's tokenizer encodes a text (a BOS in front
where it adds one, as Hugging Face and vLLM do); token-id prompts are taken as they are."""

from __future__ import annotations

from fastapi.testclient import TestClient

from specdec.models.toy import ToyLM
from specdec.server import ServerSettings, create_app
from toy_server import LetterTokenizer

BOS = 25  # 'z'


class BosLetters(LetterTokenizer):
    """Letters, with a BOS in front of a text unless asked for none (as Gemma's or Llama 3's tokenizer)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + super().encode(text)


def test_a_text_prompt_gets_the_tokenizers_bos_and_ids_are_kept():
    app = TestClient(create_app(ToyLM(26, order=2, seed=3), tokenizer=BosLetters(), settings=ServerSettings()),
                     base_url="http://localhost")
    text = app.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "temperature": 0}).json()
    ids = app.post("/v1/completions", json={"prompt": [BOS, 0, 1, 2], "max_tokens": 2, "temperature": 0}).json()
    bare = app.post("/v1/completions", json={"prompt": [0, 1, 2], "max_tokens": 2, "temperature": 0}).json()
    assert text["usage"]["prompt_tokens"] == 4 and bare["usage"]["prompt_tokens"] == 3
    assert text["choices"][0]["text"] == ids["choices"][0]["text"]
    # /tokenize counts what /v1/completions reads (lm-evaluation-harness sizes requests with it), as in vLLM
    assert app.post("/tokenize", json={"prompt": "abc"}).json()["tokens"] == [BOS, 0, 1, 2]
    assert app.post("/tokenize", json={"prompt": "abc", "add_special_tokens": False}).json()["tokens"] == [0, 1, 2]
    # a model without a chat template (a base model): chat is a 400 that names the way to serve it
    chat = app.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "abc"}], "max_tokens": 2})
    assert chat.status_code == 400 and "--chat-template" in chat.json()["error"]["message"]
