"""Queue prompts now, run them later: `enqueue` validates and queues without running the
engine; `wait_for_completion` runs everything queued and returns outputs in queue order.

python examples/queue_api.py
"""

from batchlm.engine import LLM, SamplingParams

llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct")

# Requests can be queued in several calls, each with its own sampling parameters.
greedy = SamplingParams(temperature=0.0, max_tokens=24)
creative = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=1)
ids = llm.enqueue(["The capital of France is", "The largest planet is"], greedy)
ids += llm.enqueue(["Once upon a time", "My favourite colour is"], creative)
print(f"queued request ids: {ids}")

outs = llm.wait_for_completion()  # runs the engine until every queued request is done
for out in outs:
    print(f"[{out.request_id}] {out.prompt!r} -> {out.outputs[0].text!r}")
