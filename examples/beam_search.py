"""Beam search: keep the `beam_width` most likely continuations of each prompt at every
step, and return them best first (vLLM's `LLM.beam_search`).

python examples/beam_search.py
"""

from batchlm.engine import LLM, BeamSearchParams

prompts = ["The capital of France is", "def is_prime(n):"]

llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=1024)
params = BeamSearchParams(beam_width=4, max_tokens=16)
outputs = llm.beam_search(prompts, params)
for prompt, output in zip(prompts, outputs, strict=True):
    print(f"=== {prompt!r}")
    for rank, seq in enumerate(output.sequences):
        print(f"--- beam {rank} (cumulative logprob {seq.cum_logprob:.3f}, {seq.finish_reason})")
        print(seq.text)
