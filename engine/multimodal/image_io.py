"""Images from where the front ends find them: encoded bytes, local paths, `file://`,
`data:` and `http(s)://` URLs, numpy arrays, PIL images. Each becomes a decoded RGB PIL
image, or an `ImageReadError` that names the source and the problem (missing file,
unreachable URL after retries, bytes that do not decode, an empty image).

`http(s)://` images are fetched with a timeout per connection and read, and retried a
bounded number of times after connection errors, timeouts and 5xx / 429 answers
(`BATCHLM_IMAGE_FETCH_TIMEOUT`, `BATCHLM_IMAGE_FETCH_RETRIES`); other answers fail at once.

Example:
    >>> load_image("data:image/png;base64,iVBORw0KGgo...", "row 3")
    <PIL.Image.Image image mode=RGB size=64x48>
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .. import envs
from ..errors import ImageReadError, InvalidPromptError
from .inputs import checked_image

MAX_FETCH_THREADS = 8
"""URLs fetched at once by `load_images` (the rest of a batch waits for a thread)."""

_BACKOFF_S = 0.25
"""Wait before the first retry of a URL; doubled for each later one."""


def load_image(source: Any, where: str) -> Any:
    """One image as a decoded RGB PIL image.

    Args:
        source: A PIL image; a numpy array (height × width [× 1, 3 or 4 channels], uint8);
            encoded bytes (PNG, JPEG, ... as `bytes`, `bytearray` or `memoryview`); a
            string: a `data:` URL with base64 bytes, an `http(s)://` or `file://` URL, or a
            local path; or a mapping with `bytes` or `path` (a Hugging Face datasets image).
        where: What holds the image, starting each error message (`"row 3, column
            'image'"`).

    Raises:
        ImageReadError: the source cannot be read or decoded, or holds an empty image.
    """
    from PIL import Image

    if isinstance(source, (Image.Image, np.ndarray)):
        try:
            image = checked_image(source, where)
        except InvalidPromptError as e:
            raise ImageReadError(str(e)) from None
        if isinstance(image, np.ndarray):
            image = Image.fromarray(image)
        return _rgb(image)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image(bytes(source), where, f"the encoded image ({len(source)} bytes)")
    if isinstance(source, str):
        return _load_string(source, where)
    if isinstance(source, Mapping) and ("bytes" in source or "path" in source):
        if source.get("bytes") is not None:
            return load_image(source["bytes"], where)
        if source.get("path") is not None:
            return load_image(str(source["path"]), where)
    raise ImageReadError(
        f"{where} is a {type(source).__name__}, not an image; pass encoded bytes, a path, a "
        "file://, data: or http(s):// URL, a numpy HWC uint8 array or a PIL image"
    )


def load_images(sources: Sequence[Any], wheres: Sequence[str]) -> list[Any]:
    """`load_image` of each source, URLs fetched on up to `MAX_FETCH_THREADS` threads.

    Returns:
        For each source, in order, its image or the `ImageReadError` it raised (one bad
        source never hides the others).
    """

    def one(args: tuple[Any, str]) -> Any:
        try:
            return load_image(*args)
        except ImageReadError as e:
            return e

    pairs = list(zip(sources, wheres, strict=True))
    num_urls = sum(1 for s in sources if isinstance(s, str) and _is_http(s))
    if num_urls < 2:
        return [one(p) for p in pairs]
    with ThreadPoolExecutor(min(MAX_FETCH_THREADS, num_urls)) as pool:
        return list(pool.map(one, pairs))


def decode_image(data: bytes, where: str, what: str) -> Any:
    """Encoded image bytes → a decoded RGB PIL image; `what` names them in errors."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageReadError(f"{where}: {what} holds no image: it is empty")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # a truncated file fails here, not inside the processor
    except Exception as e:
        reason = (
            "no image format Pillow reads"
            if isinstance(e, UnidentifiedImageError)
            else f"{type(e).__name__}: {e}"
        )
        raise ImageReadError(
            f"{where}: {what} cannot be decoded as an image ({reason}; its bytes start "
            f"with {data[:8]!r}); pass PNG, JPEG, WebP, GIF or another format Pillow reads"
        ) from None
    if image.width == 0 or image.height == 0:
        raise ImageReadError(f"{where}: {what} is an empty image ({image.width}x{image.height})")
    return _rgb(image)


def fetch_url(url: str, where: str) -> bytes:
    """The body of an `http(s)://` URL, with the environment's timeout and retries."""
    timeout = envs.image_fetch_timeout_s()
    retries = envs.image_fetch_retries()
    request = urllib.request.Request(url, headers={"User-Agent": "batchlm"})
    problem = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(_BACKOFF_S * 2 ** (attempt - 1))
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            problem = f"HTTP {e.code} {e.reason}"
            if e.code < 500 and e.code != 429:  # the answer will not change
                raise ImageReadError(
                    f"{where}: the image URL {_short(url)} answered {problem}; check the URL"
                ) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            problem = f"{type(reason).__name__}: {reason}"
    attempts = f"{retries + 1} attempt" + ("s" if retries else "")
    raise ImageReadError(
        f"{where}: the image URL {_short(url)} is unreachable after {attempts} ({problem}; "
        f"timeout {timeout:g} s); check the URL and the network, or raise "
        "BATCHLM_IMAGE_FETCH_TIMEOUT / BATCHLM_IMAGE_FETCH_RETRIES"
    )


def _load_string(source: str, where: str) -> Any:
    if source.startswith("data:"):
        return decode_image(_data_url_bytes(source, where), where, f"the data URL {_short(source)}")
    if _is_http(source):
        return decode_image(fetch_url(source, where), where, f"the image at {_short(source)}")
    if source.startswith("file:"):
        parsed = urllib.parse.urlparse(source)
        if parsed.netloc not in ("", "localhost"):
            raise ImageReadError(
                f"{where}: {_short(source)} names the host {parsed.netloc!r}; a file:// URL "
                "must be local (file:///path/to/image.png)"
            )
        path = Path(urllib.parse.unquote(parsed.path))
    else:
        if "://" in source[:16]:
            scheme = source.split("://", 1)[0]
            raise ImageReadError(
                f"{where}: {_short(source)} has the scheme {scheme!r}; an image string is a "
                "local path or a file://, data: or http(s):// URL (copy remote files locally "
                "first)"
            )
        path = Path(source).expanduser()
    if not path.is_file():
        state = "is a directory" if path.is_dir() else "does not exist"
        raise ImageReadError(f"{where}: the image file {path} {state}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ImageReadError(f"{where}: the image file {path} cannot be read ({e})") from None
    return decode_image(data, where, f"the image file {path}")


def _data_url_bytes(url: str, where: str) -> bytes:
    """The bytes of `data:[<media type>][;base64],<data>`."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise ImageReadError(
            f"{where}: the data URL {_short(url)} has no ',' before its data; write "
            "data:image/png;base64,<base64 bytes>"
        )
    if not header.endswith(";base64"):
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageReadError(
            f"{where}: the data URL {_short(url)} does not hold valid base64 ({e})"
        ) from None


def _is_http(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def _short(text: str, limit: int = 80) -> str:
    """`text` quoted, cut to `limit` characters with its length said (a data URL may hold
    megabytes)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def _rgb(image: Any) -> Any:
    """Three channels, as vLLM's image loader and the processors' `convert_rgb` make them:
    transparent pixels over white."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
