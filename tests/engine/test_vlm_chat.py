"""`LLM.chat` with image parts on a tiny random LLaVA: `data:` URLs, paths, `file://` and
`http(s)://` URLs and PIL images give the tokens transformers' `apply_chat_template` +
`generate` give; a URL that cannot be fetched, a missing file or bad bytes are refused,
naming the part, before anything is enqueued."""

from __future__ import annotations

import base64
import http.server
import io
import shutil
import threading
from pathlib import Path

import pytest
import torch

from batchlm.engine import LLM
from batchlm.engine.errors import ImageReadError, InvalidPromptError

from .test_vlm_llava import GREEDY, MAX_TOKENS, make_tiny_llava
from .vlm_reference import hf_model, image

# A LLaVA-1.5-style processor template: it iterates each message's parts and writes the
# placeholder where an image part is (the `openai` content format).
PARTS_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] + ' ' }}{% endif %}{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


@pytest.fixture(scope="module")
def llava_dirs(tmp_path_factory, tokenizer_files) -> dict[str, Path]:
    """The tiny LLaVA twice: with SmolLM2's ChatML template (renders content as text) and
    with `PARTS_TEMPLATE` as its processor's template."""
    root = tmp_path_factory.mktemp("chat-llava")
    chatml = make_tiny_llava(root, "default", tokenizer_files)
    parts = root / "parts"
    shutil.copytree(chatml, parts)
    (parts / "chat_template.jinja").write_text(PARTS_TEMPLATE)
    return {"chatml": chatml, "parts": parts}


@pytest.fixture(scope="module")
def llms(llava_dirs) -> dict[str, LLM]:
    return {
        name: LLM(str(path), max_model_len=160, limit_mm_per_prompt={"image": 2})
        for name, path in llava_dirs.items()
    }


def png_bytes(seed: int, height: int = 50, width: int = 60) -> bytes:
    buf = io.BytesIO()
    image(seed, height, width).save(buf, format="PNG")
    return buf.getvalue()


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(seed)).decode()


def url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@torch.inference_mode()
def hf_chat_greedy(path: Path, conversation: list[dict]) -> list[int]:
    """Transformers' processor renders and tokenizes the conversation (reading its images
    from their `url` / `path`), then the model generates."""
    model, processor = hf_model(str(path))
    inputs = processor.apply_chat_template(
        conversation,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    gen = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return gen[0, inputs["input_ids"].shape[1] :].tolist()


def test_data_url_and_file_parts_match_transformers(llms, llava_dirs, tmp_path):
    (tmp_path / "b.png").write_bytes(png_bytes(2, 70, 40))
    (tmp_path / "c.png").write_bytes(png_bytes(3))
    ours = [
        [{"role": "user", "content": [url_part(data_url(1)), {"type": "text", "text": "What?"}]}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    url_part(str(tmp_path / "b.png")),
                    {"type": "text", "text": "with"},
                    url_part((tmp_path / "c.png").as_uri()),
                ],
            }
        ],
        [{"role": "user", "content": "Text alone in the same batch."}],
    ]
    theirs = [
        [
            {
                "role": "user",
                "content": [{"type": "image", "url": data_url(1)}, ours[0][0]["content"][1]],
            }
        ],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    {"type": "image", "path": str(tmp_path / "b.png")},
                    {"type": "text", "text": "with"},
                    {"type": "image", "path": str(tmp_path / "c.png")},
                ],
            }
        ],
        [{"role": "user", "content": [{"type": "text", "text": "Text alone in the same batch."}]}],
    ]
    path = llava_dirs["parts"]
    expected = [hf_chat_greedy(path, c) for c in theirs]
    outputs = llms["parts"].chat(ours, GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected
    assert outputs[1].prompt.startswith("USER: Compare <image>\nwith <image>\nASSISTANT:")


def test_string_template_gets_the_placeholder_where_the_part_is(llms, llava_dirs):
    """A template that renders content as text (ChatML here) gets the parts joined with
    newlines, each image part as `<image>`; the tokens are those of `generate`."""
    llm = llms["chatml"]
    picture = image(4)
    conversation = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_pil", "image_pil": picture},
                {"type": "text", "text": "What is it?"},
            ],
        }
    ]
    out = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    assert "<|im_start|>user\nLook:\n<image>\nWhat is it?<|im_end|>" in out.prompt
    again = llm.generate(
        [{"prompt": out.prompt, "multi_modal_data": {"image": picture}}], GREEDY, use_tqdm=False
    )
    assert tokens([out]) == tokens(again)
    # The images matter: another picture, other tokens.
    conversation[0]["content"][1]["image_pil"] = image(5)
    assert tokens(llm.chat(conversation, GREEDY, use_tqdm=False)) != tokens([out])


class _Images(http.server.BaseHTTPRequestHandler):
    """Serves `/N.png` (image N); anything else is a 404."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        name = self.path.lstrip("/")
        if name.endswith(".png") and name[:-4].isdigit():
            body = png_bytes(int(name[:-4]))
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404, "Not Found")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_url_is_fetched(llms, image_server, tmp_path):
    llm = llms["parts"]
    (tmp_path / "6.png").write_bytes(png_bytes(6))
    question = {"type": "text", "text": "And this?"}
    fetched = llm.chat(
        [{"role": "user", "content": [url_part(f"{image_server}/6.png"), question]}],
        GREEDY,
        use_tqdm=False,
    )
    local = llm.chat(
        [{"role": "user", "content": [url_part(str(tmp_path / "6.png")), question]}],
        GREEDY,
        use_tqdm=False,
    )
    assert tokens(fetched) == tokens(local)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BAD_PARTS = {
    "404": (lambda server: url_part(f"{server}/missing.jpg"), r"answered HTTP 404"),
    "unreachable": (
        lambda server: url_part(f"http://127.0.0.1:{_free_port()}/1.png"),
        r"is unreachable after 2 attempts \(ConnectionRefusedError",
    ),
    "missing file": (lambda server: url_part("/no/such/image.png"), r"does not exist"),
    "undecodable": (
        lambda server: url_part("data:image/png;base64," + base64.b64encode(b"nope").decode()),
        r"cannot be decoded as an image",
    ),
    "no url": (
        lambda server: {"type": "image_url", "image_url": {"detail": "low"}},
        r"an image_url part needs",
    ),
    "not a PIL image": (
        lambda server: {"type": "image_pil", "image_pil": b"\x89PNG"},
        r"image_pil of type bytes",
    ),
}


@pytest.mark.parametrize("name", list(BAD_PARTS))
def test_bad_image_parts_are_refused_before_anything_runs(llms, image_server, monkeypatch, name):
    monkeypatch.setenv("BATCHLM_IMAGE_FETCH_RETRIES", "1")
    make, pattern = BAD_PARTS[name]
    llm = llms["parts"]
    good = [{"role": "user", "content": [url_part(data_url(1)), {"type": "text", "text": "ok"}]}]
    bad = [{"role": "user", "content": [{"type": "text", "text": "?"}, make(image_server)]}]
    error = ImageReadError if name not in ("no url", "not a PIL image") else InvalidPromptError
    with pytest.raises(error, match=r"conversation 1, message 0, content part 1\b.*" + pattern):
        llm.chat([good, bad], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(tokens(llm.chat(good, GREEDY, use_tqdm=False))[0]) == MAX_TOKENS


def test_image_part_on_a_text_model_names_it(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=64)
    with pytest.raises(InvalidPromptError, match=r"type='image_url'; this is a text-only model"):
        llm.chat([{"role": "user", "content": [url_part(data_url(1))]}], use_tqdm=False)
