"""Chat conversations: validation, templates (inline, file, named), tools, and `LLM.chat`
generating exactly what Hugging Face generates from its own `apply_chat_template`."""

from __future__ import annotations

import copy

import pytest

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.chat_utils import (
    apply_chat_template,
    is_batch_of_conversations,
    load_chat_template,
    render_chat_text,
    tokenize_chat_text,
    validate_conversation,
)
from batchlm.engine.errors import InvalidParamError, InvalidPromptError
from batchlm.engine.tokenizer import load_tokenizer

from .hf_reference import hf_greedy

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]

# Prints the tool names, then each message, then an extra template variable.
TOOLS_TEMPLATE = (
    "{% for t in tools or [] %}tool:{{ t.function.name }};{% endfor %}"
    "{% for m in messages %}{{ m.role }}={{ m.content }}|{% endfor %}"
    "{% if add_generation_prompt %}GO{% endif %}{{ greeting | default('') }}"
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    """SmolLM2's tokenizer with its ChatML template; never modified."""
    return load_tokenizer(smollm2_dir)


@pytest.fixture
def fresh_tokenizer(smollm2_dir):
    """A private copy that a test may change (e.g. drop its template)."""
    return load_tokenizer(smollm2_dir)


# ---- validate_conversation ---------------------------------------------------------------


@pytest.mark.parametrize(
    "messages, expected",
    [
        ("hello", ["is a str", "list of message dicts"]),
        ({"role": "user", "content": "hi"}, ["is a dict", "list of message dicts"]),
        ([], ["is empty", "at least one message"]),
        (["hi"], ["message 0 is a str", "must be a dict"]),
        ([{"content": "hi"}], ["message 0 has no 'role'", "'user'"]),
        ([{"role": 3, "content": "hi"}], ["role=3", "non-empty string"]),
        ([{"role": "", "content": "hi"}], ["role=''", "non-empty string"]),
        ([{"role": "user"}], ["message 0 has no 'content'", "give it a string"]),
        ([{"role": "user", "content": None}], ["content=None", "tool_calls"]),
        ([{"role": "user", "content": 5}], ["content of type int", "pass a string"]),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            ["content part 0", "type='image_url'", "text-only", "{'type': 'text'"],
        ),
        ([{"role": "user", "content": ["hi"]}], ["content part 0 is a str", "must be a dict"]),
        ([{"role": "user", "content": [{"type": "text"}]}], ["text=None", "string 'text'"]),
        ([{"role": "user", "content": "hi", "nmae": "x"}], ["unknown keys ['nmae']", "'name'"]),
        ([{"role": "user", "content": "hi", "name": 7}], ["name=7", "must be a string"]),
        ([{"role": "tool", "content": "1", "tool_call_id": 1}], ["tool_call_id=1", "string"]),
        (
            [{"role": "user", "content": "hi", "tool_calls": []}],
            ["role='user' and 'tool_calls'", "only assistant"],
        ),
        (
            [{"role": "assistant", "content": None, "tool_calls": "f()"}],
            ["tool_calls of type str", "pass a list"],
        ),
        (
            [{"role": "assistant", "tool_calls": ["f"]}],
            ["tool_calls[0] is a str", "must be a dict"],
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            ["tool_calls[0] has function=", "string 'name'"],
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
            ["not valid JSON", "JSON object string"],
        ),
    ],
)
def test_malformed_conversation_names_the_problem(messages, expected):
    with pytest.raises(InvalidPromptError) as info:
        validate_conversation(messages)
    for fragment in expected:
        assert fragment in str(info.value)


def test_errors_name_conversation_and_message_index():
    good = {"role": "user", "content": "hi"}
    with pytest.raises(InvalidPromptError, match=r"conversation 2, message 1 has no 'role'"):
        validate_conversation([good, {"content": "x"}], index=2)
    with pytest.raises(InvalidPromptError, match=r"conversation 4 is empty"):
        validate_conversation([], index=4)
    with pytest.raises(InvalidPromptError, match=r"message 0, content part 1 has type='audio'"):
        validate_conversation(
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "audio"}]}]
        )


def test_normalisation_joins_text_parts_and_keeps_input_intact():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"},
    ]
    before = copy.deepcopy(messages)
    out = validate_conversation(messages)
    assert messages == before
    assert out[0] == {"role": "user", "content": "a\nb"}
    assert out[1]["content"] == ""
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert out[2] == {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}
    assert validate_conversation(out) == out  # idempotent


def test_is_batch_of_conversations():
    assert not is_batch_of_conversations(CONVERSATION)
    assert is_batch_of_conversations([CONVERSATION, CONVERSATION])
    assert is_batch_of_conversations((CONVERSATION,))
    assert not is_batch_of_conversations([])
    assert not is_batch_of_conversations("hello")


# ---- load_chat_template ------------------------------------------------------------------


def test_load_chat_template_inline_file_and_missing(tmp_path):
    assert load_chat_template(None) is None
    assert load_chat_template(TOOLS_TEMPLATE) == TOOLS_TEMPLATE
    jinja = tmp_path / "tools.jinja"
    jinja.write_text(TOOLS_TEMPLATE)
    assert load_chat_template(str(jinja)) == TOOLS_TEMPLATE
    assert load_chat_template(jinja) == TOOLS_TEMPLATE
    other = tmp_path / "template.txt"
    other.write_text(TOOLS_TEMPLATE)
    assert load_chat_template(str(other)) == TOOLS_TEMPLATE

    missing = str(tmp_path / "nope.jinja")
    with pytest.raises(InvalidParamError, match=r"looks like a file path.*does not exist"):
        load_chat_template(missing)
    with pytest.raises(InvalidParamError, match="is a directory"):
        load_chat_template(str(tmp_path))
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(InvalidParamError, match="is empty"):
        load_chat_template(str(empty))
    with pytest.raises(InvalidParamError, match="Jinja template string or a path"):
        load_chat_template(42)  # type: ignore[arg-type]


# ---- rendering and tokenizing ------------------------------------------------------------


def test_ids_equal_transformers_apply_chat_template(tokenizer):
    ids = apply_chat_template(tokenizer, CONVERSATION)
    ref = tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert ids == list(ref)
    text = render_chat_text(tokenizer, CONVERSATION)
    assert text == (
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenize_chat_text(tokenizer, text) == ids


def test_add_generation_prompt_false_and_default_system_prompt(tokenizer):
    user_only = [{"role": "user", "content": "Hi"}]
    text = render_chat_text(tokenizer, user_only, add_generation_prompt=False)
    assert text.startswith(f"<|im_start|>system\n{SMOL_SYSTEM}")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n")


def test_continue_final_message(tokenizer):
    prefill = [
        {"role": "user", "content": "Finish the sentence."},
        {"role": "assistant", "content": "The answer is"},
    ]
    text = render_chat_text(
        tokenizer, prefill, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("<|im_start|>assistant\nThe answer is")
    with pytest.raises(InvalidParamError, match="cannot be combined"):
        render_chat_text(tokenizer, prefill, continue_final_message=True)
    # The same check applies when the flag arrives through chat_template_kwargs.
    with pytest.raises(InvalidParamError, match="cannot be combined"):
        apply_chat_template(
            tokenizer, prefill, chat_template_kwargs={"continue_final_message": True}
        )


def test_template_from_string_and_file_with_tools_and_kwargs(tokenizer, tmp_path):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    expected = "tool:get_weather;tool:get_time;user=Weather in Paris?|GOhello"
    time_tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    kwargs = dict(tools=[WEATHER_TOOL, time_tool], chat_template_kwargs={"greeting": "hello"})
    assert render_chat_text(tokenizer, messages, chat_template=TOOLS_TEMPLATE, **kwargs) == expected
    path = tmp_path / "tools.jinja"
    path.write_text(TOOLS_TEMPLATE)
    assert render_chat_text(tokenizer, messages, chat_template=str(path), **kwargs) == expected
    ids = apply_chat_template(tokenizer, messages, chat_template=str(path), **kwargs)
    assert ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    no_tools = render_chat_text(tokenizer, messages, chat_template=TOOLS_TEMPLATE)
    assert no_tools == "user=Weather in Paris?|GO"


def test_tool_call_arguments_reach_the_template_as_a_dict(tokenizer):
    template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}{% endfor %}"
    )
    call = {
        "id": "1",
        "type": "function",
        "function": {"name": "w", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [call]},
    ]
    assert render_chat_text(tokenizer, messages, chat_template=template) == "w(Oslo)"


def test_missing_template_says_how_to_pass_one(fresh_tokenizer, tmp_path):
    fresh_tokenizer.chat_template = None
    with pytest.raises(InvalidParamError, match=r"no chat template; pass chat_template=") as info:
        apply_chat_template(fresh_tokenizer, CONVERSATION)
    assert "LLM(...)" in str(info.value) and "chat(...)" in str(info.value)
    path = tmp_path / "t.jinja"
    path.write_text(TOOLS_TEMPLATE)
    text = render_chat_text(fresh_tokenizer, CONVERSATION, chat_template=str(path))
    assert text.startswith("system=You are a terse assistant.|")


def test_named_template_of_a_tokenizer_with_several(fresh_tokenizer):
    fresh_tokenizer.chat_template = {
        "default": "{% for m in messages %}D:{{ m.content }}{% endfor %}",
        "tool_use": "{% for m in messages %}T:{{ m.content }}{% endfor %}",
    }
    messages = [{"role": "user", "content": "x"}]
    assert render_chat_text(fresh_tokenizer, messages) == "D:x"
    assert render_chat_text(fresh_tokenizer, messages, chat_template="tool_use") == "T:x"


def test_bad_template_kwargs_tools_and_templates(tokenizer):
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(InvalidParamError, match=r"\['tokenize'\].*control tokenization"):
        apply_chat_template(tokenizer, messages, chat_template_kwargs={"tokenize": True})
    with pytest.raises(InvalidParamError, match="must be a dict"):
        apply_chat_template(tokenizer, messages, chat_template_kwargs=["x"])  # type: ignore[arg-type]
    with pytest.raises(InvalidParamError, match=r"tools\[0\] is a str"):
        apply_chat_template(tokenizer, messages, tools=["get_weather"])  # type: ignore[list-item]
    with pytest.raises(InvalidParamError, match="tools must be a list"):
        apply_chat_template(tokenizer, messages, tools=WEATHER_TOOL)  # type: ignore[arg-type]
    with pytest.raises(InvalidParamError, match="Jinja syntax error at line 1"):
        render_chat_text(tokenizer, messages, chat_template="{% for m in messages %}")
    strict = "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    with pytest.raises(InvalidPromptError, match="rejected the conversation: system first"):
        render_chat_text(tokenizer, messages, chat_template=strict)


# ---- LLM.chat against Hugging Face -------------------------------------------------------

BATCH = [
    CONVERSATION,
    [{"role": "user", "content": "Write a haiku about rain."}],  # template adds its system turn
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": [{"type": "text", "text": "How are you?"}]},
    ],
]


def _hf_chat_ids(hf_tokenizer, conversation) -> list[int]:
    enc = hf_tokenizer.apply_chat_template(
        validate_conversation(conversation),  # text parts joined, as batchlm and vLLM do
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    return enc["input_ids"][0].tolist()


@pytest.mark.skipif(not hasattr(LLM, "chat"), reason="LLM.chat is not wired yet")
def test_chat_greedy_matches_hf(tiny_model_factory):
    from transformers import AutoTokenizer

    path = tiny_model_factory("llama")
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path))
    llm = LLM(str(path), max_model_len=256, seed=0)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    prompts = [_hf_chat_ids(hf_tokenizer, c) for c in BATCH]
    expected = hf_greedy(path, prompts, 16)

    single = llm.chat(CONVERSATION, params, use_tqdm=False)
    assert len(single) == 1
    assert single[0].prompt_token_ids == prompts[0]
    assert single[0].outputs[0].token_ids == expected[0]

    outs = llm.chat(BATCH, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.outputs[0].token_ids for o in outs] == expected
    texts = [
        hf_tokenizer.apply_chat_template(
            validate_conversation(c), add_generation_prompt=True, tokenize=False
        )
        for c in BATCH
    ]
    assert [o.prompt for o in outs] == texts

    with pytest.raises(InvalidPromptError, match=r"conversation 1, message 0 has no 'role'"):
        llm.chat([CONVERSATION, [{"content": "hi"}]], params, use_tqdm=False)


def test_llm_chat_with_a_named_template(tiny_model_factory, tmp_path):
    """`chat(chat_template="tool_use")` and `LLM(chat_template="tool_use")` pick the
    tokenizer's named template (the name was read as a file path before), and a name the
    tokenizer lacks is refused, naming the templates it has."""
    from transformers import AutoTokenizer

    folder = tmp_path / "named"
    src = tiny_model_factory("llama")
    folder.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    tok = AutoTokenizer.from_pretrained(str(src))
    tok.chat_template = {
        "default": "{% for m in messages %}D:{{ m.content }}{% endfor %}",
        "tool_use": "{% for m in messages %}T:{{ m.content }}{% endfor %}",
    }
    tok.save_pretrained(str(folder))
    messages = [{"role": "user", "content": "x"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    llm = LLM(str(folder), max_model_len=64)
    assert llm.chat(messages, params)[0].prompt == "D:x"
    out = llm.chat(messages, params, chat_template="tool_use")[0]
    assert out.prompt == "T:x" and out.prompt_token_ids == tok("T:x")["input_ids"]
    with pytest.raises(InvalidParamError, match=r"'tool_uses' is neither.*default, tool_use"):
        llm.chat(messages, params, chat_template="tool_uses")
    llm.shutdown()
    named = LLM(str(folder), max_model_len=64, chat_template="tool_use")
    assert named.chat(messages, params)[0].prompt == "T:x"
    named.shutdown()
    with pytest.raises(InvalidParamError, match="'rag' is neither"):
        LLM(str(folder), max_model_len=64, chat_template="rag")
