"""Two small LoRA adapters for the bundled SmolLM2-135M-Instruct, made with PEFT, then prompts
run across them and the base model in one call (CPU is fine; needs `pip install peft`).

python examples/lora_generate.py [--adapters out/lora_adapters]

The adapters hold random weights (PEFT's `init_lora_weights=False`): they change the text
without teaching the model anything. They are written once to `--adapters`, where the demo
job `conf/lora_demo.yaml` reads them: run this script first, then
`batchlm run conf/lora_demo.yaml`.
"""

import argparse
from pathlib import Path

import torch

from batchlm.engine import LLM, LoRARequest, SamplingParams
from batchlm.engine.loader import resolve_model

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ADAPTERS = {
    # name: (seed, the projections it adapts)
    "red": (1, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "blue": (2, ["gate_proj", "up_proj", "down_proj"]),
}


def make_adapters(folder: Path) -> dict[str, str]:
    """Each adapter of `ADAPTERS` saved by PEFT under `folder` (kept if already there)."""
    import peft
    from transformers import AutoModelForCausalLM

    paths = {}
    for name, (seed, targets) in ADAPTERS.items():
        out = folder / name
        if not (out / "adapter_config.json").is_file():
            base = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype=torch.float32)
            torch.manual_seed(seed)
            config = peft.LoraConfig(
                r=8, lora_alpha=8, target_modules=targets, init_lora_weights=False
            )
            peft.get_peft_model(base, config).save_pretrained(out)
        paths[name] = str(out)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", default="out/lora_adapters", help="where to write them")
    args = parser.parse_args()
    paths = make_adapters(Path(args.adapters))
    print("adapters:", paths)

    llm = LLM(MODEL, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=256)
    loras = {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(paths.items(), 1)}
    prompts = ["The capital of France is", "Write a haiku about autumn leaves:"]
    rows = [(prompt, name) for prompt in prompts for name in (None, *loras)]
    outputs = llm.generate(
        [prompt for prompt, _ in rows],
        SamplingParams(temperature=0, max_tokens=16),
        lora_request=[loras.get(name) for _, name in rows],  # None: the base model
    )
    for (prompt, name), out in zip(rows, outputs, strict=True):
        print(f"[{name or 'base'}] {prompt!r} -> {out.outputs[0].text!r}")
    print("the same rows as a job: batchlm run conf/lora_demo.yaml")


if __name__ == "__main__":
    main()
