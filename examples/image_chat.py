"""Images in prompts and chats on a tiny LLaVA-1.5 with random weights, built here from a
config (no weights ship) with SmolLM2's real tokenizer; CPU is fine.

python examples/image_chat.py [--model out/tiny_llava]

The model is written once to `--model`, where the demo job `conf/caption_demo.yaml` reads
it: run this script first, then `batchlm run conf/caption_demo.yaml`. Random weights write
random text: the point is the path an image takes (decoded, prepared by the checkpoint's
processor, encoded by the vision tower where the prompt's placeholder is).
"""

import argparse
import base64
import shutil
import tempfile
from pathlib import Path

import torch
from PIL import Image

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.loader import resolve_model

IMAGES = Path(__file__).resolve().parents[1] / "conf" / "data" / "images"
# A LLaVA-1.5-style template: the placeholder where each image part is.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] + ' ' }}{% endif %}{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def make_model(folder: Path) -> str:
    """A seeded random LLaVA (CLIP tower of 42-pixel images, Llama language model) with its
    processor, saved to `folder` (kept if already there)."""
    import transformers

    if (folder / "config.json").is_file():
        return str(folder)
    with tempfile.TemporaryDirectory() as tmp:
        source = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / name, Path(tmp) / name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(tmp)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(
            size={"shortest_edge": 42}, crop_size={"height": 42, "width": 42}
        ),
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=42,
            patch_size=14,
        ),
        text_config=transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=9,
    )
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("out/tiny_llava"))
    args = parser.parse_args()
    llm = LLM(make_model(args.model), max_model_len=128, limit_mm_per_prompt={"image": 2})
    params = SamplingParams(temperature=0, max_tokens=12)

    # generate: the prompt holds the placeholder; the image goes in multi_modal_data.
    files = sorted(IMAGES.glob("*.png"))
    prompts = [
        {
            "prompt": "USER: <image>\nWhat shape is this? ASSISTANT:",
            "multi_modal_data": {"image": Image.open(f)},
        }
        for f in files
    ]
    for f, out in zip(files, llm.generate(prompts, params, use_tqdm=False), strict=True):
        print(f"Image: {f.name!r}")
        print(f"Generated: {out.outputs[0].text!r}")

    # chat: image parts as vLLM takes them (a path, a file:// or data: URL, http(s)://).
    data_url = "data:image/png;base64," + base64.b64encode(files[0].read_bytes()).decode()
    conversation = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url}},
                {"type": "text", "text": "Compare it with"},
                {"type": "image_url", "image_url": {"url": files[1].as_uri()}},
            ],
        }
    ]
    out = llm.chat(conversation, params, use_tqdm=False)[0]
    print(f"Chat prompt: {out.prompt!r}")
    print(f"Chat reply: {out.outputs[0].text!r}")


if __name__ == "__main__":
    main()
