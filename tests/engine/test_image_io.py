"""`multimodal/image_io.py`: every source form decodes to the same RGB pixels, transient
HTTP failures are retried a bounded number of times, and every failure names its source."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import urllib.parse

import numpy as np
import pytest
from PIL import Image

from batchlm.engine.errors import ImageReadError
from batchlm.engine.multimodal.image_io import load_image, load_images

PIXELS = np.random.RandomState(0).randint(0, 256, (12, 10, 3), dtype=np.uint8)


def encoded(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def test_every_form_gives_the_same_pixels(tmp_path):
    data = encoded(Image.fromarray(PIXELS))
    path = tmp_path / "a b.png"  # a space: file:// URLs are percent-encoded
    path.write_bytes(data)
    forms = [
        data,
        bytearray(data),
        memoryview(data),
        str(path),
        path.as_uri(),
        "data:image/png;base64," + base64.b64encode(data).decode(),
        "data:image/png," + urllib.parse.quote_from_bytes(data),
        PIXELS,
        Image.fromarray(PIXELS),
        {"bytes": data, "path": None},
        {"bytes": None, "path": str(path)},
    ]
    for form in forms:
        img = load_image(form, "x")
        assert img.mode == "RGB"
        assert np.array_equal(np.asarray(img), PIXELS), type(form)


def test_other_modes_become_rgb_over_white():
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)  # opaque red; the rest transparent
    img = np.asarray(load_image(encoded(Image.fromarray(rgba, "RGBA")), "x"))
    assert img[0, 0].tolist() == [255, 0, 0] and img[1, 1].tolist() == [255, 255, 255]
    gray = np.full((3, 4), 7, np.uint8)
    assert np.asarray(load_image(gray, "x")).shape == (3, 4, 3)


BAD = {
    "empty bytes": (b"", r"row 2: the encoded image \(0 bytes\) holds no image"),
    "not an image": (b"hello world", r"cannot be decoded as an image \(no image format"),
    "truncated": (encoded(Image.fromarray(PIXELS))[:60], r"cannot be decoded as an image"),
    "missing file": ("/no/such.png", r"the image file /no/such.png does not exist"),
    "a directory": ("/", r"the image file / is a directory"),
    "remote file": ("file://host/a.png", r"names the host 'host'"),
    "other scheme": ("s3://bucket/a.png", r"has the scheme 's3'"),
    "bad base64": ("data:image/png;base64,@@@", r"does not hold valid base64"),
    "no comma": ("data:image/png;base64", r"has no ','"),
    "empty array": (np.zeros((0, 3, 3), np.uint8), r"is an empty image"),
    "float array": (np.zeros((2, 2, 3), np.float32), r"pass uint8 pixel values"),
    "a number": (3, r"row 2 is a int, not an image"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_failures_name_the_source(name):
    source, pattern = BAD[name]
    with pytest.raises(ImageReadError, match=pattern):
        load_image(source, "row 2")


class _Flaky(http.server.BaseHTTPRequestHandler):
    """`/busy/N.png` answers 503 N times, then the image; `/gone.png` is a 410."""

    hits: dict[str, int] = {}

    def do_GET(self):  # noqa: N802 (http.server's name)
        hits = self.hits[self.path] = self.hits.get(self.path, 0) + 1
        if self.path.startswith("/busy/") and hits > int(self.path.split("/")[2][:-4]):
            body = encoded(Image.fromarray(PIXELS))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(503 if self.path.startswith("/busy/") else 410)

    def log_message(self, *args):
        pass


def test_transient_failures_are_retried_a_bounded_number_of_times(monkeypatch):
    monkeypatch.setenv("BATCHLM_IMAGE_FETCH_RETRIES", "2")
    monkeypatch.setattr("batchlm.engine.multimodal.image_io._BACKOFF_S", 0.01)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        sources = [f"{base}/busy/2.png", f"{base}/busy/3.png", f"{base}/gone.png"]
        ok, busy, gone = load_images(sources, ["a", "b", "c"])
        assert np.array_equal(np.asarray(ok), PIXELS)
        assert isinstance(busy, ImageReadError)
        assert "unreachable after 3 attempts (HTTP 503" in str(busy)
        assert isinstance(gone, ImageReadError) and "answered HTTP 410" in str(gone)
        assert _Flaky.hits == {"/busy/2.png": 3, "/busy/3.png": 3, "/gone.png": 1}
    finally:
        server.shutdown()
        server.server_close()


def test_fetch_knobs_are_checked(monkeypatch):
    from batchlm.engine import envs

    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "2.5")
    assert envs.image_fetch_timeout_s() == 2.5
    monkeypatch.setenv("BATCHLM_IMAGE_FETCH_TIMEOUT", "0")
    with pytest.raises(ValueError, match="BATCHLM_IMAGE_FETCH_TIMEOUT='0' must be"):
        envs.image_fetch_timeout_s()
    monkeypatch.setenv("BATCHLM_IMAGE_FETCH_RETRIES", "-1")
    with pytest.raises(ValueError, match="must be a whole number"):
        envs.image_fetch_retries()
