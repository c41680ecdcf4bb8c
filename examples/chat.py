"""Chat with SmolLM2-135M-Instruct: the model's chat template turns messages into a prompt.

python examples/chat.py
"""

from batchlm.engine import LLM, SamplingParams

llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct")
sampling_params = SamplingParams(temperature=0.0, max_tokens=32)


def print_outputs(outputs):
    for output in outputs:
        print(f"Prompt:    {output.prompt!r}")
        print(f"Generated: {output.outputs[0].text!r}")
        print("-" * 60)


# One conversation: a list of messages.
conversation = [
    {"role": "system", "content": "You are a helpful assistant. Answer in one sentence."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I help you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]
print_outputs(llm.chat(conversation, sampling_params, use_tqdm=False))

# A batch: a list of conversations, generated together.
system = {"role": "system", "content": "You are a concise assistant."}
questions = ["What is the capital of Italy?", "Name three primary colours.", "What is 7 * 6?"]
conversations = [[system, {"role": "user", "content": q}] for q in questions]
print_outputs(llm.chat(conversations, sampling_params, use_tqdm=True))

# A custom chat template (a Jinja string or the path of a .jinja file) replaces the model's.
template = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
print_outputs(llm.chat(conversations[:1], sampling_params, chat_template=template, use_tqdm=False))
