"""What `SamplingParams` does: greedy vs sampling, seeds, stop strings, several completions,
log probabilities and penalties (vLLM's names and defaults).

python examples/sampling_params.py
"""

from batchlm.engine import LLM, SamplingParams

llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct")
prompt = "Three facts about the Moon:\n1."


def show(title: str, params: SamplingParams) -> None:
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    print(f"=== {title}")
    for c in out.outputs:
        print(f"  [{c.index}] ({c.finish_reason}, stop_reason={c.stop_reason!r}) {c.text!r}")


# Greedy: temperature=0 always takes the most likely token, so reruns are identical.
show("greedy", SamplingParams(temperature=0.0, max_tokens=32))

# Sampling: temperature and nucleus (top_p) sampling; a seed makes the request reproducible
# whatever else is in the batch.
show("temperature=0.8, top_p=0.95, seed=42", SamplingParams(temperature=0.8, top_p=0.95, seed=42))

# Stop strings end the completion and are cut from the text (unless
# include_stop_str_in_output=True); stop_reason says which one matched.
show("stop at '2.'", SamplingParams(temperature=0.0, max_tokens=32, stop=["2.", "\n\n"]))

# n completions of one prompt.
show("n=3", SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=0))

# Penalties: presence / frequency (additive, OpenAI-style) and repetition (multiplicative).
show(
    "penalties",
    SamplingParams(
        temperature=0.0,
        max_tokens=32,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
    ),
)

# Log probabilities: the sampled token and the top-3 alternatives at each position.
out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3))[0]
completion = out.outputs[0]
print(f"=== logprobs=3 (cumulative logprob {completion.cumulative_logprob:.3f})")
for token_id, top in zip(completion.token_ids, completion.logprobs or [], strict=True):
    chosen = top[token_id]
    others = ", ".join(f"{lp.decoded_token!r}:{lp.logprob:.2f}" for lp in top.values())
    print(f"  {chosen.decoded_token!r} ({chosen.logprob:.2f})  top: {others}")
