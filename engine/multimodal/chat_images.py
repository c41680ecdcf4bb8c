"""Image parts of chat messages, in vLLM's forms, → the prompt's images in order, and the
messages the chat template renders with the model's placeholder where each part was.

A part is `{"type": "image_url", "image_url": {"url": URL}}` (a `data:` URL with base64
bytes, a local path, a `file://` or an `http(s)://` URL; `"image_url": URL` too) or
`{"type": "image_pil", "image_pil": PIL image}`. Templates come in vLLM's two content
formats: an `openai` template iterates a message's parts, and gets each image as
`{"type": "image"}` (where it writes the placeholder, as the checkpoint's processor
template does); a `string` template renders `content` as text, and gets the parts joined
with newlines, each image part as the placeholder text (`<image>`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from ..errors import InvalidParamError, InvalidPromptError
from .image_io import load_images

IMAGE_PART_TYPES = ("image_url", "image_pil")
"""The image parts `LLM.chat` reads (vLLM's names)."""

_TAKEN_TYPES = (*IMAGE_PART_TYPES, "image")
"""Parts taken out; a bare `{"type": "image"}` (transformers' form) is refused by name."""

CONTENT_FORMATS = ("auto", "string", "openai")
"""`chat_template_content_format` values, as in vLLM."""


class ChatImages(NamedTuple):
    conversation: list[Any]
    """The messages with each image part replaced (the caller's are not modified)."""
    images: list[Any]
    """The images, decoded (RGB PIL), in the order of their parts."""


def split_image_parts(conversation: Any, index: int, placeholder: str | None) -> ChatImages:
    """Take the image parts out of one conversation and read their images.

    Args:
        conversation: The messages, as given to `LLM.chat` (checked later; anything that
            is not a list of dicts with list content is passed on unchanged).
        index: The conversation's position in the call, named in errors.
        placeholder: The text each image part becomes (a `string` template), or None:
            each becomes `{"type": "image"}` (an `openai` template).

    Raises:
        InvalidPromptError: naming the conversation, message and part: a malformed image
            part, or an image that cannot be read (`ImageReadError`).
    """
    if not isinstance(conversation, (list, tuple)):
        return ChatImages(conversation, [])  # type: ignore[arg-type]
    messages = list(conversation)
    sources: list[Any] = []
    wheres: list[str] = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, (list, tuple)):
            continue
        parts = list(content)
        changed = False
        for j, part in enumerate(parts):
            if not isinstance(part, Mapping) or part.get("type") not in _TAKEN_TYPES:
                continue
            where = f"conversation {index}, message {m}, content part {j}"
            sources.append(_part_source(part, where))
            wheres.append(where)
            parts[j] = (
                {"type": "image"} if placeholder is None else {"type": "text", "text": placeholder}
            )
            changed = True
        if changed:
            messages[m] = {**message, "content": parts}
    images = load_images(sources, wheres)
    failed = next((e for e in images if isinstance(e, Exception)), None)
    if failed is not None:
        raise failed
    return ChatImages(messages, images)


def uses_content_parts(content_format: str, template: str | None) -> bool:
    """Whether messages reach the template as lists of parts (`openai`) rather than text.

    Args:
        content_format: `auto` (the template decides), `string` or `openai`.
        template: The chat template's text (for `auto`).
    """
    if content_format not in CONTENT_FORMATS:
        raise InvalidParamError(
            f"chat_template_content_format={content_format!r} must be one of {CONTENT_FORMATS}"
        )
    if content_format != "auto":
        return content_format == "openai"
    return template is not None and iterates_content(template)


def iterates_content(template: str) -> bool:
    """True when the template loops over a message's `content` (`{% for part in
    message['content'] %}`, filtered or not): it expects a list of parts. A template that
    does not parse counts as a `string` one (its own error comes when it renders)."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in tree.find_all(nodes.For):
        target = loop.iter
        while isinstance(target, (nodes.Filter, nodes.Test)) and target.node is not None:
            target = target.node
        if isinstance(target, nodes.Getitem) and isinstance(target.arg, nodes.Const):
            if target.arg.value == "content":
                return True
        if isinstance(target, nodes.Getattr) and target.attr == "content":
            return True
        if isinstance(target, nodes.Name) and target.name == "content":
            return True
    return False


def template_text(tokenizer: Any, template: str | None) -> str | None:
    """The text of the template `resolve_chat_template` chose: itself, one of the
    tokenizer's named templates, or (None) the tokenizer's own."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        if template in own:
            return own[template]
        return template if template is not None else own.get("default")
    return template if template is not None else own


def _part_source(part: Mapping[str, Any], where: str) -> Any:
    kind = part["type"]
    if kind == "image":
        raise InvalidPromptError(
            f"{where} has type='image'; give the image itself as {{'type': 'image_url', "
            "'image_url': {'url': ...}} (a data: URL, a path, a file:// or http(s):// URL) "
            "or {'type': 'image_pil', 'image_pil': image}"
        )
    value = part.get(kind)
    if kind == "image_url":
        url = value.get("url") if isinstance(value, Mapping) else value
        if not isinstance(url, str) or not url:
            raise InvalidPromptError(
                f"{where} has image_url={value!r:.80}; an image_url part needs "
                "{'image_url': {'url': URL}} with a data: URL, a path, a file:// or "
                "http(s):// URL"
            )
        return url
    from PIL import Image

    if not isinstance(value, Image.Image):
        raise InvalidPromptError(
            f"{where} has image_pil of type {type(value).__name__}; an image_pil part holds "
            "a PIL image ({'type': 'image_pil', 'image_pil': Image.open(path)})"
        )
    return value


def with_images(
    prompt: dict[str, Any], images: list[Any], mm_processor_kwargs: dict[str, Any] | None
) -> dict[str, Any]:
    """A rendered conversation's prompt dict with its images (none: as it is) and, with
    them, the processor's kwargs."""
    if images:
        prompt["multi_modal_data"] = {"image": images}
        if mm_processor_kwargs is not None:
            prompt["mm_processor_kwargs"] = mm_processor_kwargs
    return prompt
