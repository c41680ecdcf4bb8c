"""The operator API as written down: docs/operators.md lists every option with its default,
`help()` of each public function names what the docs name, and the Python examples of the
README's operator section and of docs/operators.md are lines of the example scripts that CI
runs (tests/test_examples.py), so they cannot drift from code that works."""

from __future__ import annotations

import pydoc
import re
import textwrap
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from batchlm.operators import spark_udf
from batchlm.operators.config import OperatorConfig
from batchlm.operators.ray_data import ProcessorConfig, build_processor
from batchlm.operators.row_schema import output_fields
from batchlm.operators.row_spec import TASKS, RowSpec
from batchlm.operators.rows import ModelInfo

REPO = Path(__file__).resolve().parents[2]
OPERATORS_MD = REPO / "docs" / "operators.md"


def _options() -> dict[str, object]:
    """Every option a user sets: the stage's fields (ProcessorConfig's included) and the row
    contract's, name → default (MISSING for required ones)."""
    out: dict[str, object] = {}
    for cls in (ProcessorConfig, RowSpec):
        for f in fields(cls):
            if not f.init or f.name == "spec":
                continue
            default = f.default
            if f.default_factory is not MISSING:
                default = f.default_factory()
            out[f.name] = default
    return out


def _table_rows(text: str) -> dict[str, str]:
    """`| \\`name\\` | default | meaning |` rows → name: default cell."""
    return {
        m.group(1): m.group(2).strip()
        for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", text, flags=re.MULTILINE)
    }


def test_operators_md_lists_every_option_with_its_default():
    rows = _table_rows(_section(OPERATORS_MD.read_text(), "## The config"))
    for name, default in _options().items():
        assert name in rows, f"docs/operators.md does not list option {name!r}"
        shown = "required" if default is MISSING else f"`{default!r}`"
        if isinstance(default, str):
            shown = f'`"{default}"`'
        assert rows[name] == shown, (name, rows[name], shown)
    assert set(rows) <= set(_options()), set(rows) - set(_options())


def test_help_names_every_option():
    text = pydoc.render_doc(ProcessorConfig, renderer=pydoc.plaintext)
    create = pydoc.render_doc(OperatorConfig.create, renderer=pydoc.plaintext)
    for name in _options():
        assert name in text, f"help(ProcessorConfig) does not name {name!r}"
        assert name in create, f"help(OperatorConfig.create) does not name {name!r}"
    build = pydoc.render_doc(build_processor, renderer=pydoc.plaintext)
    for word in ("concurrency", "num_gpus", "max_tasks_per_actor", "error", "max_batch_retries"):
        assert word in build


@pytest.mark.parametrize("task", TASKS)
def test_spark_help_names_the_returned_columns(task):
    factory = getattr(spark_udf, f"{task}_udf")
    text = pydoc.render_doc(factory, renderer=pydoc.plaintext)
    spec = RowSpec(task)
    for f in output_fields(spec, ModelInfo(8, 2)):
        assert f.name in text, (task, f.name)
    mapped = pydoc.render_doc(spark_udf.map_in_arrow, renderer=pydoc.plaintext)
    for f in output_fields(spec, ModelInfo(8, 2)):
        assert f.name in mapped, (task, f.name)
    for role in spec.input_roles:
        assert role in text, (task, role)


def _python_blocks(text: str) -> list[tuple[str, str]]:
    """(the text since the previous block, the block) of every ```python block."""
    out = []
    last = 0
    for m in re.finditer(r"```python\n(.*?)```", text, flags=re.DOTALL):
        out.append((text[last : m.start()], m.group(1)))
        last = m.end()
    return out


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


@pytest.mark.parametrize(
    ("path", "heading"),
    [
        ("README.md", "## Operators: Ray Data and Spark"),
        ("docs/operators.md", "## Ray Data"),
        ("docs/operators.md", "## Spark"),
    ],
)
def test_operator_examples_are_the_scripts_lines(path, heading):
    section = _section((REPO / path).read_text(), heading)
    named = re.findall(r"`examples/(\w+)\.py`", section)
    assert named, f"{path} {heading}: no example script named"
    blocks = _python_blocks(section)
    assert blocks, f"{path} {heading}: no Python example"
    scripts = {name: (REPO / "examples" / f"{name}.py").read_text() for name in named}
    for _, block in blocks:
        code = textwrap.dedent(block)
        assert any(code in script for script in scripts.values()), (
            f"{path} {heading}: this example is not a part of {sorted(scripts)}:\n{code}"
        )
