"""Generate completions for a few prompts with the bundled SmolLM2-135M-Instruct (CPU is fine).

python examples/basic.py
"""

from batchlm.engine import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=0)

llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct")
outputs = llm.generate(prompts, sampling_params)

print("-" * 60)
for output in outputs:
    print(f"Prompt:    {output.prompt!r}")
    print(f"Generated: {output.outputs[0].text!r}")
    print("-" * 60)
