"""The batch-invariant matmul against the float32 product, and its invariant: every row of
the output is bitwise the same whatever rows come with it (how many, in which order)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from batchlm.kernels.matmul import (
    DEFAULT_TABLE_PATH,
    MIXED_BLOCK_K,
    REF_ROWS,
    MatmulLaunch,
    MatmulShape,
    choose_matmul_launch,
    load_matmul_table,
    matmul,
    matmul_ref,
    table_entry,
)

from .helpers import DTYPES, gpu_only

# The float32 reference rounded to the output dtype against the kernel's own float32 sum.
TOLERANCE = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-2, 2e-3),
    torch.bfloat16: (1.5e-1, 1e-2),
}
# Small tiles keep the interpreter fast and still cover several tiles in every dimension.
SMALL = {"block_m": 16, "block_n": 16, "block_k": 16}


def _float32_product(x, w, bias=None, scale=None):
    y = x.float() @ w.float().T
    if scale is not None:
        y = y * scale[None, :]
    return (y if bias is None else y + bias.float()).to(x.dtype)


def _operands(num_m, num_n, num_k, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_m, num_k, generator=gen).to(dtype).to(device)
    w = (torch.randn(num_n, num_k, generator=gen) / num_k**0.5).to(dtype).to(device)
    b = torch.randn(num_n, generator=gen).to(dtype).to(device)
    return x, w, b


@pytest.mark.parametrize(
    ("num_m", "num_n", "num_k", "launch"),
    [
        (5, 48, 64, SMALL),  # several tiles along N and K
        (37, 50, 100, SMALL),  # ragged in every dimension
        (1, 40, 24, SMALL),
        gpu_only(300, 4096, 4096, {}),
        gpu_only(7, 151936, 896, {}),
        gpu_only(1, 14336, 4096, {}),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matmul_matches_the_float32_product(num_m, num_n, num_k, launch, bias, dtype, device):
    x, w, b = _operands(num_m, num_n, num_k, dtype, device, seed=num_m + num_n)
    b = b if bias else None
    atol, rtol = TOLERANCE[dtype]
    expected = _float32_product(x, w, b).float()
    torch.testing.assert_close(matmul(x, w, b, **launch).float(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(matmul_ref(x, w, b).float(), expected, atol=atol, rtol=rtol)


def _assert_rows_invariant(fn, x, w, b):
    """Row i of `fn` on the whole batch equals it alone, in every prefix of the batch, in
    reversed order and between other rows: bit for bit."""
    full = fn(x, w, b)
    n = x.shape[0]
    for i in (0, n // 2, n - 1):
        assert torch.equal(fn(x[i : i + 1], w, b), full[i : i + 1]), f"row {i} alone"
    for m in (1, 2, 3, 7, n):
        assert torch.equal(fn(x[:m], w, b), full[:m]), f"first {m} rows"
    assert torch.equal(fn(x.flip(0), w, b), full.flip(0)), "reversed"
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    assert torch.equal(fn(x[perm], w, b), full[perm]), "shuffled"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matmul_rows_do_not_depend_on_the_batch(dtype, device):
    x, w, b = _operands(40, 40, 48, dtype, device)
    _assert_rows_invariant(lambda *a: matmul(*a, **SMALL), x, w, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_n", "num_k"), [(6144, 4096), (4096, 14336), (49152, 576)])
def test_matmul_rows_do_not_depend_on_the_batch_at_model_shapes(num_n, num_k, dtype, device):
    """With the default launch of real layer shapes: 1 row up to 300 (decode to prefill)."""
    x, w, b = _operands(300, num_n, num_k, dtype, device)
    _assert_rows_invariant(matmul, x, w, None)


@pytest.mark.gpu
def test_the_tables_launches_give_a_row_the_same_bits_at_every_row_count(device):
    """Every entry of the committed table for this GPU: a row's bits alone, in a decode
    batch and in a prefill chunk, each run on its own bucket's launch."""
    from batchlm.kernels.launch import device_name

    entries = [
        (shape, buckets)
        for shape, buckets in load_matmul_table().items()
        if shape.device_name == device_name(device) and shape.weight_dtype == shape.dtype
    ]
    if not entries:
        pytest.skip(f"the table has no entry for {device_name(device)}")
    for shape, buckets in entries:
        dtype = getattr(torch, shape.dtype)
        most = max(16384 if shape.n < 100_000 else 512, buckets[-1][0] + 1)
        x, w, _ = _operands(most, shape.n, shape.k, dtype, device)
        full = matmul(x, w)
        for m in sorted({1, 3, 255, *(rows for rows, _ in buckets)}):
            assert torch.equal(matmul(x[:m], w), full[:m]), f"{shape}: the first {m} rows"


def test_the_reference_rows_do_not_depend_on_the_batch():
    """The CPU path of the mode. Plain `F.linear` on CPU does depend on the batch (a row
    alone is summed in another order than inside 64 rows); the chunked reference does
    not."""
    x, w, b = _operands(64, 96, 80, torch.float32, torch.device("cpu"))
    differs = [m for m in (1, 2, 3, 7) if not torch.equal(F.linear(x[:m], w), F.linear(x, w)[:m])]
    assert differs, "F.linear became batch-invariant on this CPU: the reference's chunks can go"
    _assert_rows_invariant(matmul_ref, x, w, b)
    assert REF_ROWS > 1


def test_quantized_weights_with_scales(device):
    """int8 weights with per-channel scales, converted in the kernel (fp8 on the GPU)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 40, generator=gen).to(device)
    q = torch.randint(-127, 128, (24, 40), generator=gen, dtype=torch.int8).to(device)
    scale = (torch.rand(24, generator=gen) / 100).to(device)
    expected = _float32_product(x, q.float(), None, scale)
    torch.testing.assert_close(matmul(x, q, weight_scale=scale, **SMALL), expected)
    torch.testing.assert_close(matmul_ref(x, q, weight_scale=scale), expected)


@pytest.mark.gpu
def test_fp8_weights_with_scales(device):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(33, 256, generator=gen).to(torch.bfloat16).to(device)
    w = torch.randn(128, 256, generator=gen).to(torch.float8_e4m3fn).to(device)
    scale = (torch.rand(128, generator=gen) / 100).to(device)
    expected = _float32_product(x, w.float(), None, scale).float()
    torch.testing.assert_close(
        matmul(x, w, weight_scale=scale).float(), expected, atol=1e-2, rtol=1e-2
    )
    _assert_rows_invariant(lambda a, w_, _: matmul(a, w_, weight_scale=scale), x, w, None)


def test_matmul_refuses_what_it_would_misread(device):
    x = torch.randn(3, 32, device=device)
    w = torch.randn(8, 32, device=device)
    with pytest.raises(ValueError, match="weight"):
        matmul(x, torch.randn(8, 16, device=device))
    with pytest.raises(ValueError, match="dtype"):
        matmul(x, w.half())
    with pytest.raises(ValueError, match="stride"):
        matmul(x, torch.randn(32, 8, device=device).T)
    with pytest.raises(ValueError, match="bias"):
        matmul(x, w, torch.randn(9, device=device))
    with pytest.raises(ValueError, match="weight_scale"):
        matmul(x, w.to(torch.int8))
    with pytest.raises(ValueError, match="weight_scale"):
        matmul(x, w, weight_scale=torch.ones(8, device=device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_m", "num_n", "num_k"), [(40, 48, 64), (5, 40, 72), (33, 24, 40)])
def test_tma_loads_give_the_pointer_loads_bits(num_m, num_n, num_k, dtype, device):
    """The TMA kernel's tiles (zeros past the edges) reach the same dots as the masked
    pointer loads': equal bits, partial tiles along M, N and K included, with scale and
    bias; operands whose rows the TMA cannot address take the pointer kernel."""
    x, w, b = _operands(num_m, num_n, num_k, dtype, device)
    pointer = matmul(x, w, b, **SMALL)
    assert torch.equal(matmul(x, w, b, **SMALL, tma=True), pointer)
    atol, rtol = TOLERANCE[dtype]
    expected = _float32_product(x, w, b).float()
    torch.testing.assert_close(pointer.float(), expected, atol=atol, rtol=rtol)
    _assert_rows_invariant(lambda *a: matmul(*a, **SMALL, tma=True), x, w, b)
    # Rows 2 elements apart past the end of each row: not 16-byte aligned.
    wide = torch.zeros(num_m, num_k + 2, dtype=dtype, device=device)
    wide[:, :num_k] = x
    assert torch.equal(matmul(wide[:, :num_k], w, b, **SMALL, tma=True), pointer)
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (num_n, num_k), generator=gen, dtype=torch.int8).to(device)
    scale = (torch.rand(num_n, generator=gen) / 100).to(device)
    assert torch.equal(
        matmul(x, q, weight_scale=scale, **SMALL, tma=True),
        matmul(x, q, weight_scale=scale, **SMALL),
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_m", "num_n", "num_k", "launch"),
    [
        (300, 4096, 4096, MatmulLaunch(128, 128, 64, 8, 4)),
        (257, 6144, 4096, MatmulLaunch(64, 64, 128, 4, 4)),
        (1, 4096, 14336, MatmulLaunch(16, 32, 256, 4, 4)),
        (40, 896, 4864, MatmulLaunch(128, 256, 64, 8, 3)),
    ],
)
def test_tma_loads_give_the_pointer_loads_bits_at_model_shapes(num_m, num_n, num_k, launch, device):
    x, w, _ = _operands(num_m, num_n, num_k, torch.bfloat16, device)
    pointer = matmul(x, w, **launch._asdict())
    assert torch.equal(matmul(x, w, **launch._replace(tma=True)._asdict()), pointer)


def test_launch_depends_on_the_weight_alone():
    assert choose_matmul_launch(4096, 4096, torch.bfloat16) == MatmulLaunch(64, 64, 64, 4, 4)
    assert choose_matmul_launch(151936, 896, torch.bfloat16).block_n == 128
    with pytest.raises(ValueError, match="block_k=48"):
        choose_matmul_launch(64, 64, torch.float16, block_k=48)


def _write_table(path, *entries):
    path.write_text(json.dumps({"entries": [table_entry(*e) for e in entries]}))
    return load_matmul_table(path)


def test_launch_table_picks_the_smallest_bucket_that_holds_the_rows(tmp_path):
    shape = MatmulShape("cpu", 48, 64, "float32", "float32")
    buckets = {1: MatmulLaunch(16, 16, 16, 1, 1), 8: MatmulLaunch(32, 16, 16, 2, 2)}
    table = _write_table(tmp_path / "t.json", (shape, buckets))
    got = [
        choose_matmul_launch(48, 64, torch.float32, num_m=m, shape=shape, table=table)
        for m in (1, 2, 8, 9, 10_000)
    ]
    assert got == [buckets[m] for m in (1, 8, 8, 8, 8)]
    # Overrides apply over the entry.
    got = choose_matmul_launch(48, 64, torch.float32, shape=shape, table=table, num_warps=4)
    assert got == buckets[1]._replace(num_warps=4)
    # Another device, size or dtype: the defaults, the same launch at any number of rows.
    default = choose_matmul_launch(48, 64, torch.float32, table={})
    for other in (
        shape._replace(device_name="NVIDIA H100"),
        shape._replace(n=64),
        shape._replace(weight_dtype="float8_e4m3fn"),
    ):
        for m in (1, 10_000):
            got = choose_matmul_launch(48, 64, torch.float32, num_m=m, shape=other, table=table)
            assert got == default
    assert load_matmul_table(tmp_path / "t.json") is table  # read once
    assert load_matmul_table(tmp_path / "missing.json") == {}


def test_repository_table_covers_w1_w2_w3_on_the_h200():
    """The committed table loads and holds the layers of W1 / W3 (Llama-3.1-8B) and W2
    (Qwen2.5-0.5B) in bf16, LM heads included, from one row up."""
    table = load_matmul_table(DEFAULT_TABLE_PATH)
    shapes = [
        (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
        (1152, 896), (896, 896), (9728, 896), (896, 4864), (151936, 896),
    ]  # fmt: skip
    raw = {(e["n"], e["k"]): e for e in json.loads(DEFAULT_TABLE_PATH.read_text())["entries"]}
    for n, k in shapes:
        buckets = table[MatmulShape("NVIDIA H200", n, k, "bfloat16", "bfloat16")]
        assert buckets[0][0] == 1, (n, k)
        mixed = len({launch.block_k for _, launch in buckets}) > 1
        assert raw[n, k].get(MIXED_BLOCK_K, False) is mixed, (n, k)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda e: e.update(colour="red"), "expected the keys"),
        (lambda e: e.update(n=0), "n=0"),
        (lambda e: e.update(dtype=16), "dtype=16"),
        (lambda e: e["launches"].update({"x": [16, 16, 16, 1, 1]}), "bucket 'x'"),
        (lambda e: e["launches"].update({"1": [16, 24, 16, 4, 3]}), "block_n=24"),
        (lambda e: e["launches"].update({"1": [16, 16, 16, 4]}), "bucket 1"),
        (lambda e: e["launches"].update({"64": [64, 16, 32, 4, 3]}), r"block_k \[16, 32\]"),
        (lambda e: e.update({MIXED_BLOCK_K: "yes"}), f"{MIXED_BLOCK_K}='yes'"),
        (lambda e: e["launches"].update({"1": [16, 16, 16, 1, 1, 1]}), "tma=1"),
        (lambda e: e["launches"].update({"1": [16, 16, 16, 1, 1, True, 0]}), "bucket 1"),
    ],
)
def test_launch_table_is_validated(tmp_path, edit, match):
    shape = MatmulShape("cpu", 8, 8, "float32", "float32")
    entry = table_entry(shape, {1: MatmulLaunch(16, 16, 16, 1, 1)})
    edit(entry)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"entries": [entry]}))
    with pytest.raises(ValueError, match=match):
        load_matmul_table(path)


def test_mixed_block_k_needs_the_tuners_word(tmp_path, device):
    """Launches of different `block_k` order a row's sum differently under the interpreter
    (and on any device until compared there): an entry mixes them only with
    `MIXED_BLOCK_K`, which `table_entry` writes only when told the bits were compared."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 256, generator=gen).to(device)
    w = torch.randn(48, 256, generator=gen).to(device)
    small, large = MatmulLaunch(16, 16, 16, 1, 1), MatmulLaunch(16, 16, 64, 1, 1)
    if device.type == "cpu":
        assert not torch.equal(matmul(x, w, **small._asdict()), matmul(x, w, **large._asdict()))
    shape = MatmulShape("cpu", 48, 256, "float32", "float32")
    buckets = {1: small, 64: large}
    with pytest.raises(ValueError, match=MIXED_BLOCK_K):
        table_entry(shape, buckets)
    entry = table_entry(shape, buckets, same_bits_across_block_k=True)
    assert entry[MIXED_BLOCK_K] is True
    assert MIXED_BLOCK_K not in table_entry(shape, {1: small, 64: small._replace(block_m=32)})
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps({"entries": [entry]}))
    assert load_matmul_table(path)[shape] == sorted(buckets.items())
    del entry[MIXED_BLOCK_K]
    path.write_text(json.dumps({"entries": [entry]}))
    load_matmul_table.cache_clear()
    with pytest.raises(ValueError, match=r"block_k \[16, 64\]"):
        load_matmul_table(path)


def test_matmul_runs_the_tables_launch_for_its_rows(tmp_path, device, monkeypatch):
    """`matmul` looks its launch up by device name, sizes, dtypes and rows: each call's
    rows equal those of its bucket's launch passed by hand, and differ from the default's
    (another K step); the buckets share a K step, so a row's bits do not change with the
    number of rows."""
    from batchlm.kernels import matmul as module
    from batchlm.kernels.launch import device_name

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=gen).to(device)
    w = torch.randn(48, 64, generator=gen).to(device)
    buckets = {4: MatmulLaunch(16, 16, 16, 1, 1), 64: MatmulLaunch(32, 32, 16, 2, 2)}
    shape = MatmulShape(device_name(device), 48, 64, "float32", "float32")
    table = _write_table(tmp_path / "t.json", (shape, buckets))
    default = matmul(x, w)
    monkeypatch.setattr(module, "load_matmul_table", lambda: table)
    few, many = matmul(x[:3], w), matmul(x, w)
    assert torch.equal(few, matmul(x[:3], w, **buckets[4]._asdict()))
    assert torch.equal(many, matmul(x, w, **buckets[64]._asdict()))
    assert torch.equal(few, many[:3])
    assert not torch.equal(many, default), "the launches give the same bits: no evidence"
    torch.testing.assert_close(many, F.linear(x, w), atol=1e-4, rtol=1e-4)
