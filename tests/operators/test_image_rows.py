"""Image columns in the row contract, on a tiny random LLaVA: encoded bytes, paths, pixel
arrays (Ray's `read_images`), and a Spark `binaryFile` source's `content` give each row what
`LLM.generate` / `LLM.chat` give on the decoded images; a row whose image cannot be read
gets its `error` and the other rows run; the image column is left out of the output unless
`keep_images` is set."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from batchlm.engine import LLM, SamplingParams
from batchlm.operators.config import OperatorConfig
from batchlm.operators.rows import ModelInfo, RowSpec, output_schema, process_table

from ..engine.test_vlm_llava import make_tiny_llava
from ..engine.vlm_reference import image

SAMPLING = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
PROMPT = "USER: <image>\nWhat is it? ASSISTANT:"


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, tokenizer_files) -> str:
    return str(make_tiny_llava(tmp_path_factory.mktemp("rows-llava"), "default", tokenizer_files))


@pytest.fixture(scope="module")
def llm(llava_dir) -> LLM:
    return LLM(llava_dir, max_model_len=128)


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> Path:
    """Three PNG files of other sizes, and one file that is not an image."""
    folder = tmp_path_factory.mktemp("images")
    for seed, (h, w) in enumerate([(50, 60), (70, 40), (42, 42)]):
        image(seed, h, w).save(folder / f"{seed}.png")
    return folder


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    image(seed).save(buf, format="PNG")
    return buf.getvalue()


def expected_texts(llm: LLM, prompts: list) -> list[str]:
    outs = llm.generate(prompts, SamplingParams(**SAMPLING), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_bytes_paths_and_arrays_match_generate(llm, image_dir):
    spec = RowSpec("generate", sampling_params=SAMPLING)
    paths = [str(image_dir / f"{i}.png") for i in range(3)]
    decoded = [Image.open(p).convert("RGB") for p in paths]
    expected = expected_texts(
        llm, [{"prompt": PROMPT, "multi_modal_data": {"image": d}} for d in decoded]
    )
    pixels = pa.array(
        [np.asarray(d).tolist() for d in decoded], pa.list_(pa.list_(pa.list_(pa.uint8())))
    )
    for cells in (pa.array([Path(p).read_bytes() for p in paths]), pa.array(paths), pixels):
        table = pa.table({"id": [0, 1, 2], "prompt": [PROMPT] * 3, "image": cells})
        out = process_table(llm, spec, table)
        assert out.column("generated_text").to_pylist() == expected, cells.type
        assert out.column("error").null_count == 3
        assert "image" not in out.column_names  # left out unless keep_images


def test_a_broken_image_fails_its_row_alone(llm, image_dir):
    spec = RowSpec("generate", sampling_params=SAMPLING, keep_images=True)
    cells = [png(0), b"not an image", None, b"", png(1)]
    prompts = [PROMPT, PROMPT, "USER: text alone ASSISTANT:", PROMPT, PROMPT]
    table = pa.table({"id": list(range(5)), "prompt": prompts, "image": cells})
    out = process_table(llm, spec, table)
    errors = out.column("error").to_pylist()
    assert errors[1].startswith("column 'image': the encoded image (12 bytes) cannot be decoded")
    assert errors[3] == "column 'image': the encoded image (0 bytes) holds no image: it is empty"
    good = [0, 2, 4]
    assert [errors[i] for i in good] == [None] * 3
    images = [Image.open(io.BytesIO(png(0))), None, Image.open(io.BytesIO(png(1)))]
    reference = [
        p if img is None else {"prompt": p, "multi_modal_data": {"image": img}}
        for p, img in zip([prompts[i] for i in good], images, strict=True)
    ]
    texts = out.column("generated_text").to_pylist()
    assert [texts[i] for i in good] == expected_texts(llm, reference)
    assert out.column("image").to_pylist() == cells  # kept, as asked
    info = ModelInfo.from_llm(llm)
    assert out.schema == output_schema(spec, info, table.schema)


def test_chat_rows_from_a_prompt_and_an_image(llm, image_dir):
    spec = RowSpec("chat", sampling_params=SAMPLING)
    table = pa.table({"prompt": ["What is it?", "And this?"], "image": [png(0), None]})
    out = process_table(llm, spec, table)
    assert out.column_names == [
        "prompt",
        "generated_text",
        "finish_reason",
        "num_input_tokens",
        "num_output_tokens",
        "error",
    ]
    picture = Image.open(io.BytesIO(png(0)))
    conversations = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_pil", "image_pil": picture},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ],
        [{"role": "user", "content": "And this?"}],
    ]
    outs = llm.chat(conversations, SamplingParams(**SAMPLING), use_tqdm=False)
    assert out.column("generated_text").to_pylist() == [o.outputs[0].text for o in outs]
    # A messages column with image parts (here a path) works as LLM.chat does.
    messages = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": str(image_dir / "1.png")}},
                    {"type": "text", "text": "Hm?"},
                ],
            }
        ]
    ]
    out = process_table(
        llm, spec, pa.table({"messages": [str(m).replace("'", '"') for m in messages]})
    )
    assert out.column("error").to_pylist() == [None]
    ref = llm.chat(messages, SamplingParams(**SAMPLING), use_tqdm=False)
    assert out.column("generated_text").to_pylist() == [ref[0].outputs[0].text]


# ---- Ray Data and Spark ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local():
    pytest.importorskip("ray")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    import ray.data

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level="WARNING",
        object_store_memory=256 * 1024 * 1024,
    )
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    yield ray
    ray.shutdown()


def test_ray_read_images(ray_local, llm, llava_dir, image_dir, tmp_path):
    from batchlm.operators.ray_data import ProcessorConfig, build_processor

    config = ProcessorConfig.create(
        llava_dir,
        "generate",
        engine_kwargs={"max_model_len": 128},
        sampling_params=SAMPLING,
        batch_size=2,
    )
    processor = build_processor(config, preprocess=lambda row: {**row, "prompt": PROMPT})
    ds = ray_local.data.read_images(str(image_dir), include_paths=True, file_extensions=["png"])
    processor(ds).write_parquet(str(tmp_path / "out"))
    import pyarrow.parquet as pq

    rows = sorted(pq.read_table(tmp_path / "out").to_pylist(), key=lambda r: r["path"])
    assert [Path(r["path"]).name for r in rows] == ["0.png", "1.png", "2.png"]
    assert all("image" not in r and r["error"] is None for r in rows)
    decoded = [Image.open(image_dir / f"{i}.png").convert("RGB") for i in range(3)]
    expected = expected_texts(
        llm, [{"prompt": PROMPT, "multi_modal_data": {"image": d}} for d in decoded]
    )
    assert [r["generated_text"] for r in rows] == expected


@pytest.fixture(scope="module")
def spark():
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[1]")
        .appName("batchlm-test-image-rows")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def test_spark_binary_file_content(spark, llm, llava_dir, image_dir, tmp_path):
    from pyspark.sql import functions as F

    from batchlm.operators.spark_udf import map_in_arrow

    folder = tmp_path / "files"
    folder.mkdir()
    for i in range(2):
        (folder / f"{i}.png").write_bytes((image_dir / f"{i}.png").read_bytes())
    (folder / "broken.png").write_bytes(b"\x89PNG broken")
    config = OperatorConfig.create(
        llava_dir,
        "generate",
        engine_kwargs={"max_model_len": 128},
        sampling_params=SAMPLING,
        image_column="content",
    )
    df = spark.read.format("binaryFile").load(str(folder)).withColumn("prompt", F.lit(PROMPT))
    out = map_in_arrow(df, config)
    assert "content" not in out.columns and "path" in out.columns
    rows = {Path(r["path"]).name: r for r in (row.asDict() for row in out.collect())}
    assert "cannot be decoded as an image" in rows["broken.png"]["error"]
    assert rows["broken.png"]["error"].startswith("column 'content': ")
    decoded = [Image.open(image_dir / f"{i}.png").convert("RGB") for i in range(2)]
    expected = expected_texts(
        llm, [{"prompt": PROMPT, "multi_modal_data": {"image": d}} for d in decoded]
    )
    assert [rows[f"{i}.png"]["generated_text"] for i in range(2)] == expected
    assert [rows[f"{i}.png"]["error"] for i in range(2)] == [None, None]


def test_spark_pandas_udf_with_an_image_column(spark, llm, llava_dir, image_dir):

    from batchlm.operators.spark_udf import generate_udf

    config = OperatorConfig.create(
        llava_dir, "generate", engine_kwargs={"max_model_len": 128}, sampling_params=SAMPLING
    )
    cells = [(image_dir / "0.png").read_bytes(), b"not an image", None]
    df = spark.createDataFrame(
        [
            (i, PROMPT if c is not None else "USER: hello ASSISTANT:", c)
            for i, c in enumerate(cells)
        ],
        "id int, prompt string, image binary",
    )
    udf = generate_udf(config, images=True)
    rows = sorted(
        (
            r.asDict()
            for r in df.select("id", udf("prompt", "image").alias("o"))
            .select("id", "o.*")
            .collect()
        ),
        key=lambda r: r["id"],
    )
    decoded = Image.open(image_dir / "0.png").convert("RGB")
    expected = expected_texts(
        llm, [{"prompt": PROMPT, "multi_modal_data": {"image": decoded}}, "USER: hello ASSISTANT:"]
    )
    assert rows[0]["generated_text"] == expected[0] and rows[0]["error"] is None
    assert "cannot be decoded as an image" in rows[1]["error"]
    assert rows[2]["generated_text"] == expected[1] and rows[2]["error"] is None
