"""Generate with the bundled SmolLM2-135M-Instruct on whatever device is here (CPU is fine).

python examples/generate.py
"""

from batchlm.engine import LLM, SamplingParams

prompts = [
    "The capital of France is",
    "Write a haiku about autumn leaves:",
    "def is_prime(n):",
    "Three facts about the Moon:\n1.",
]

llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=1024)
params = SamplingParams(temperature=0.0, max_tokens=32)
for out in llm.generate(prompts, params):
    completion = out.outputs[0]
    print(f"--- {out.prompt!r} ({completion.finish_reason}, {len(completion.token_ids)} tokens)")
    print(completion.text)
