"""Beam search with the bundled SmolLM2-135M-Instruct on whatever device is here (CPU is fine).

python examples/beam_search.py
"""

from batchlm.engine import LLM
from batchlm.engine.beam_search import BeamSearchParams, beam_search

prompts = [
    "The capital of France is",
    {"prompt": "def is_prime(n):"},
]

llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=1024)
params = BeamSearchParams(beam_width=4, max_tokens=24)
outputs = beam_search(llm, prompts, params, use_tqdm=True)
for prompt, output in zip(prompts, outputs, strict=True):
    print(f"=== {prompt!r}")
    for rank, seq in enumerate(output.sequences):
        score = seq.cum_logprob / len(seq.output_token_ids) ** params.length_penalty
        print(f"--- beam {rank} (score {score:.3f}, {seq.finish_reason})")
        print(seq.text)
