"""Chat conversations → prompt text and token ids through the model's chat template.

The semantics follow vLLM's `LLM.chat`: messages are OpenAI-style dicts, text content parts
are joined with newlines, the template is rendered with Hugging Face's Jinja renderer and the
text is then tokenized without adding special tokens.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import InvalidParamError, InvalidPromptError
from .inputs import check_text

# Keys a message may carry; anything else is a typo or a format we do not understand.
_MESSAGE_KEYS = frozenset(
    {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning", "reasoning_content"}
)

# `tokenizer.apply_chat_template` arguments that control tokenization, which this module does
# itself; in `chat_template_kwargs` they would silently change what comes back.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tokenize",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
    }
)

# Characters that only a Jinja template (never a file name) contains.
_JINJA_MARKERS = ("{{", "{%", "{#", "\n")


def is_template_name(value: Any) -> bool:
    """`value` can only be the name of a tokenizer's named template (`tool_use`, say): a
    short word, neither a template (no Jinja syntax) nor an existing file."""
    return (
        isinstance(value, str)
        and re.fullmatch(r"[A-Za-z0-9_.-]+", value) is not None
        and not Path(value).expanduser().exists()
    )


def is_batch_of_conversations(messages: Any) -> bool:
    """True for a list of conversations, False for one conversation (a list of dicts)."""
    return (
        isinstance(messages, (list, tuple))
        and len(messages) > 0
        and isinstance(messages[0], (list, tuple))
    )


def validate_conversation(
    messages: Any, index: int | None = None, keep_content_parts: bool = False
) -> list[dict[str, Any]]:
    """Check one conversation and return a normalised copy ready for a chat template.

    Text content parts (`[{"type": "text", "text": ...}, ...]`) are joined with newlines
    (or, with `keep_content_parts`, every content becomes a list of text parts and the
    `{"type": "image"}` parts `multimodal.chat_images` left, for templates that iterate
    a message's parts), an assistant message with `tool_calls` and no content gets `content=""`, and tool-call
    `arguments` given as a JSON string are parsed into a dict (what Hugging Face templates
    expect). The input is not modified.

    Args:
        messages: A list of message dicts, each with a string `role` and `content`, and
            optionally `name`, `tool_calls`, `tool_call_id`, `reasoning_content`.
        index: The conversation's position in a batch, named in error messages.

        keep_content_parts: Keep content as a list of parts (see above).

    Returns:
        A new list of new message dicts whose `content` is a string (a list of parts
        with `keep_content_parts`).

    Raises:
        InvalidPromptError: naming the conversation, the message and the fix.
    """
    where = f"conversation {index}" if index is not None else "conversation"
    if not isinstance(messages, (list, tuple)):
        raise InvalidPromptError(
            f"{where} is a {type(messages).__name__}; pass a list of message dicts such as "
            "[{'role': 'user', 'content': 'Hello'}] (or a list of such lists for a batch)"
        )
    if not messages:
        raise InvalidPromptError(f"{where} is empty; it needs at least one message")
    return [
        _validate_message(m, f"{where}, message {i}", keep_content_parts)
        for i, m in enumerate(messages)
    ]


def _validate_message(message: Any, where: str, keep_parts: bool) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise InvalidPromptError(
            f"{where} is a {type(message).__name__}; each message must be a dict such as "
            "{'role': 'user', 'content': 'Hello'}"
        )
    unknown = sorted(str(k) for k in message if k not in _MESSAGE_KEYS)
    if unknown:
        raise InvalidPromptError(
            f"{where} has unknown keys {unknown}; a message may only have {sorted(_MESSAGE_KEYS)}"
        )
    role = message.get("role")
    if role is None:
        raise InvalidPromptError(
            f"{where} has no 'role'; add one such as 'system', 'user' or 'assistant'"
        )
    if not isinstance(role, str) or not role:
        raise InvalidPromptError(
            f"{where} has role={role!r}; the role must be a non-empty string such as 'user'"
        )
    out: dict[str, Any] = {"role": role}

    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise InvalidPromptError(
                f"{where} has role={role!r} and 'tool_calls'; only assistant messages call tools"
            )
        out["tool_calls"] = _validate_tool_calls(tool_calls, where)

    content = message.get("content")
    if content is None:
        if not out.get("tool_calls"):
            missing = "has content=None" if "content" in message else "has no 'content'"
            raise InvalidPromptError(
                f"{where} {missing}; give it a string (or a list of "
                "{'type': 'text', 'text': ...} parts); only an assistant message with "
                "tool_calls may leave it out"
            )
        content = ""  # as vLLM: a tool-calling turn with no text renders as empty content
    out["content"] = _content_text(content, where, keep_parts)
    if keep_parts:
        out["content"] = _content_parts(content, where)

    for key in ("name", "tool_call_id", "reasoning", "reasoning_content"):
        value = message.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidPromptError(
                f"{where} has {key}={value!r} ({type(value).__name__}); it must be a string"
            )
        out[key] = value
    for key, value in out.items():
        if isinstance(value, str):
            check_text(value, f"{where}, {key}")
        elif key == "content":
            for j, part in enumerate(value):
                if "text" in part:
                    check_text(part["text"], f"{where}, content part {j}")
    return out


def _content_parts(content: Any, where: str) -> list[dict[str, Any]]:
    """Content as a list of new `{"type": "text", "text": ...}` and `{"type": "image"}`
    parts (already checked by `_content_text`, images aside)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [
        {"type": "image"} if part.get("type") == "image" else {"type": "text", "text": part["text"]}
        for part in content
    ]


def _content_text(content: Any, where: str, keep_parts: bool = False) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise InvalidPromptError(
            f"{where} has content of type {type(content).__name__}; pass a string or a list "
            "of {'type': 'text', 'text': ...} parts"
        )
    texts = []
    for j, part in enumerate(content):
        part_where = f"{where}, content part {j}"
        if not isinstance(part, dict):
            raise InvalidPromptError(
                f"{part_where} is a {type(part).__name__}; each part must be a dict "
                "{'type': 'text', 'text': ...}"
            )
        kind = part.get("type")
        if keep_parts and kind == "image" and part.keys() == {"type"}:
            continue  # an image part already taken out (`multimodal.chat_images`)
        if kind != "text":
            raise InvalidPromptError(
                f"{part_where} has type={kind!r}; this is a text-only model, so only "
                "{'type': 'text', 'text': ...} parts are supported (images need a "
                "vision-language model such as LlavaForConditionalGeneration; drop audio "
                "and video, or describe them in text)"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidPromptError(
                f"{part_where} has text={text!r}; a text part needs a string 'text'"
            )
        texts.append(text)
    return "\n".join(texts)  # vLLM joins text parts with newlines


def _validate_tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, (list, tuple)):
        raise InvalidPromptError(
            f"{where} has tool_calls of type {type(tool_calls).__name__}; pass a list of "
            "{'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': ...}}"
        )
    out = []
    for j, call in enumerate(tool_calls):
        call_where = f"{where}, tool_calls[{j}]"
        if not isinstance(call, dict):
            raise InvalidPromptError(
                f"{call_where} is a {type(call).__name__}; each tool call must be a dict"
            )
        call = dict(call)
        function = call.get("function")
        if function is not None:
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise InvalidPromptError(
                    f"{call_where} has function={function!r}; it must be a dict with a string "
                    "'name' and 'arguments' (a dict or a JSON string)"
                )
            function = dict(function)
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                # OpenAI sends arguments as JSON text; Hugging Face templates index into them
                # (`arguments | tojson`, `arguments.items()`), so they get a dict, as in vLLM.
                try:
                    function["arguments"] = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError as e:
                    raise InvalidPromptError(
                        f"{call_where} has function.arguments={arguments!r}, which is not "
                        f"valid JSON ({e.msg}); pass a dict or a JSON object string"
                    ) from None
            call["function"] = function
        out.append(call)
    return out


def load_chat_template(value: str | os.PathLike[str] | None) -> str | None:
    """A chat template given inline or as a path to a file holding one.

    A string with Jinja syntax (`{{`, `{%`, `{#`) or a newline is the template itself;
    anything else is read as a file path (`.jinja` or any other text file).

    Args:
        value: A Jinja template, a path to one, or None (use the tokenizer's template).

    Returns:
        The template text, or None when `value` is None.

    Raises:
        InvalidParamError: the value looks like a path but no such file exists, or the file
            is empty.
    """
    if value is None:
        return None
    if isinstance(value, str) and any(m in value for m in _JINJA_MARKERS):
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidParamError(
            f"chat_template={value!r} must be a Jinja template string or a path to a file "
            "holding one"
        )
    path = Path(value).expanduser()
    if not path.is_file():
        state = "is a directory" if path.is_dir() else "does not exist"
        raise InvalidParamError(
            f"chat_template={str(value)!r} looks like a file path, but {path} {state}; pass "
            "the path of a template file (e.g. template.jinja) or the template text itself "
            "(with Jinja syntax such as {{ ... }} or {% ... %})"
        )
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise InvalidParamError(f"chat_template file {path} is empty; it must hold a template")
    return text


def render_chat_text(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    chat_template: str | os.PathLike[str] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any] | Callable[..., Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    keep_content_parts: bool = False,
) -> str:
    """The prompt text the chat template makes of one conversation.

    Args:
        tokenizer: A transformers tokenizer (its `chat_template` is the default).
        conversation: Message dicts; checked with `validate_conversation`.
        chat_template: A template, a path to one, or the name of one of the tokenizer's
            named templates; None uses the tokenizer's.
        add_generation_prompt: Append the header that starts an assistant reply.
        continue_final_message: Leave the last message open so the model continues it
            (for prefilling the start of a reply); excludes `add_generation_prompt`.
        tools: Tool JSON schemas (or Python functions) handed to the template as `tools`.
        chat_template_kwargs: Extra template variables (e.g. `enable_thinking`); as in
            vLLM, they override the named arguments above when both are given.
        keep_content_parts: Messages reach the template as lists of parts (vLLM's
            `openai` content format; see `validate_conversation`).

    Raises:
        InvalidParamError: no template, both generation flags, or bad template kwargs.
        InvalidPromptError: a malformed conversation, or the template rejected it.
    """
    messages = validate_conversation(conversation, keep_content_parts=keep_content_parts)
    kwargs: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "tools": _check_tools(tools),
        "chat_template": resolve_chat_template(tokenizer, chat_template),
    }
    kwargs.update(_check_template_kwargs(chat_template_kwargs))
    if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
        raise InvalidParamError(
            "add_generation_prompt=True and continue_final_message=True cannot be combined: "
            "one starts a new assistant message, the other continues the last one; pass "
            "add_generation_prompt=False to continue the final message"
        )
    from jinja2 import TemplateError, TemplateSyntaxError

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except TemplateSyntaxError as e:
        raise InvalidParamError(
            f"the chat template has a Jinja syntax error at line {e.lineno}: {e.message}"
        ) from e
    except TemplateError as e:  # e.g. `raise_exception("roles must alternate")`
        raise InvalidPromptError(f"the chat template rejected the conversation: {e}") from e
    except ValueError as e:  # e.g. continue_final_message when the template drops its text
        raise InvalidPromptError(f"could not apply the chat template: {e}") from e
    return text


def tokenize_chat_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered chat text.

    Special tokens are not added: the template already writes BOS (and every other control
    token) itself, so letting the tokenizer add them would double BOS on models such as
    Llama 3. vLLM and `transformers`' own `apply_chat_template(tokenize=True)` do the same.
    """
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def apply_chat_template(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    chat_template: str | os.PathLike[str] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any] | Callable[..., Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Prompt token ids for one conversation: `render_chat_text` then `tokenize_chat_text`.

    Arguments and errors are those of `render_chat_text`.

    Example:
        >>> ids = apply_chat_template(tok, [{"role": "user", "content": "Hi"}])
    """
    text = render_chat_text(
        tokenizer,
        conversation,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
    )
    return tokenize_chat_text(tokenizer, text)


def resolve_chat_template(
    tokenizer: Any, chat_template: str | os.PathLike[str] | None
) -> str | None:
    """The template to render with: the name of one of the tokenizer's named templates
    (transformers looks it up), a template's text (given inline or read from a file), or
    None for the tokenizer's own (which must exist). A name is looked up before anything
    else, so `"tool_use"` is never taken for a file path.

    Raises:
        InvalidParamError: no template at all, or a value that is neither a named template,
            a template nor a file.
    """
    own = getattr(tokenizer, "chat_template", None)
    names = sorted(own) if isinstance(own, dict) else []
    if isinstance(chat_template, str) and chat_template in names:
        return chat_template
    is_text = isinstance(chat_template, str) and any(m in chat_template for m in _JINJA_MARKERS)
    if names and isinstance(chat_template, str) and not is_text:
        if not Path(chat_template).expanduser().exists():
            raise InvalidParamError(
                f"chat_template={chat_template!r} is neither one of the tokenizer's named "
                f"templates ({', '.join(names)}) nor a file; pass one of those names, the "
                "path of a template file or the template text itself"
            )
    template = load_chat_template(chat_template)
    if template is None and own is None:
        raise InvalidParamError(
            "this model's tokenizer has no chat template; pass chat_template= (a Jinja "
            "template string or the path of a .jinja file) to LLM(...) or chat(...)"
        )
    return template


def _check_tools(tools: Any) -> list[Any] | None:
    if tools is None:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise InvalidParamError(
            f"tools must be a list of tool JSON schemas (dicts), got {type(tools).__name__}"
        )
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) or callable(tool)):
            raise InvalidParamError(
                f"tools[{i}] is a {type(tool).__name__}; pass a JSON schema dict such as "
                "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}"
            )
    return list(tools)


def _check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidParamError(
            f"chat_template_kwargs must be a dict of template variables, got "
            f"{type(kwargs).__name__}"
        )
    reserved = sorted(k for k in kwargs if k in _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise InvalidParamError(
            f"chat_template_kwargs has {reserved}, which control tokenization rather than "
            "the template; batchlm tokenizes the rendered text itself, so remove them"
        )
    bad = sorted(repr(k) for k in kwargs if not isinstance(k, str))
    if bad:
        raise InvalidParamError(f"chat_template_kwargs keys must be strings, got {bad}")
    return dict(kwargs)
