"""The native CPU kernels (cpu_kernels.c through furnace_trio.runtime.native) against torch.

Every kernel is compared with a plain torch computation of the same math. The int8 linear
kernel's batch invariance is claimed bitwise, so it is tested with ``torch.equal``. The
build itself is tested in ``test_native_build.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from furnace_trio.runtime import native
from furnace_trio.runtime.quant import (
    NativeInt8Linear,
    NativeQ4Linear,
    dequantize_q4,
    dequantize_q8,
    quantize_q4,
    quantize_q8,
    quantize_weight,
)

from .native_builds import BUILDS, load_build


@pytest.fixture(scope="module", params=list(BUILDS))
def kernels(request: pytest.FixtureRequest) -> native.Kernels:
    return load_build(request.param)


def _w8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    y = x.double() @ (q.double() * scale.double()[:, None]).T
    return (y if bias is None else y + bias.double()).float()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (7, 40), (1000, 576)])
def test_w8_linear_matches_dequantized_matmul(
    kernels: native.Kernels, rows: int, out_features: int, in_features: int
) -> None:
    torch.manual_seed(rows * out_features + in_features)
    q, scale = quantize_weight(torch.randn(out_features, in_features))
    x = torch.randn(rows, in_features)
    for bias in (None, torch.randn(out_features)):
        out = torch.empty(rows, out_features)
        kernels.w8_linear(x, kernels.pack_w8(q), scale, bias, out)
        torch.testing.assert_close(out, _w8_reference(x, q, scale, bias), rtol=1e-5, atol=1e-4)


def test_w8_linear_rows_are_batch_invariant(kernels: native.Kernels) -> None:
    """A row's output is bitwise the same alone and at any place in any batch."""
    torch.manual_seed(0)
    q, scale = quantize_weight(torch.randn(1030, 576))
    assert torch.equal(kernels.unpack_w8(kernels.pack_w8(q), 1030), q)
    q = kernels.pack_w8(q)
    x = torch.randn(1, 576)
    alone = torch.empty(1, 1030)
    kernels.w8_linear(x, q, scale, None, alone)
    for neighbours in (1, 2, 3, 4, 6, 7, 15, 31):
        others = torch.randn(neighbours, 576) * torch.logspace(-3, 3, neighbours)[:, None]
        for at in (0, neighbours // 2, neighbours):
            batch = torch.cat([others[:at], x, others[at:]])
            out = torch.empty(len(batch), 1030)
            kernels.w8_linear(batch, q, scale, None, out)
            assert torch.equal(out[at], alone[0]), (neighbours, at)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("panels", [0, 1, 2, 7, 64, 301])
@pytest.mark.parametrize("rows", [1, 16])
def test_panels_are_shared_out_once_each(
    kernels: native.Kernels, rows: int, panels: int, threads: int
) -> None:
    """Every panel of a linear goes to exactly one thread (a second taking raises)."""
    owner = kernels.panel_owners(rows, panels, threads).tolist()
    assert len(owner) == panels
    assert all(0 <= o < threads for o in owner)  # -1: a panel no thread took


@pytest.mark.parametrize("threads", [2, 3])
def test_a_held_up_thread_share_goes_to_the_others(kernels: native.Kernels, threads: int) -> None:
    """One row: each thread owns a span of the panels, but a thread that starts only after
    the others ran out of panels finds its span taken by them: the linear does not wait
    for it."""
    owner = kernels.panel_owners(1, 60, threads, hold_first=True).tolist()
    assert len(owner) == 60
    assert 0 not in owner
    assert set(owner) <= set(range(1, threads))


def test_native_int8_linear_layer(kernels: native.Kernels) -> None:
    torch.manual_seed(1)
    w = torch.randn(300, 200) * 0.05
    b = torch.randn(300)
    layer = NativeInt8Linear(w, b, kernels)
    q, scale = quantize_weight(w)
    for rows in (1, 9, 70):
        x = torch.randn(2, rows, 200)
        got = layer(x)
        assert got.shape == (2, rows, 300)
        want = _w8_reference(x.reshape(-1, 200), q, scale, b).reshape(2, rows, 300)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        # weight-only int8: close to the float layer
        rel = float((got - F.linear(x, w, b)).norm() / F.linear(x, w, b).norm())
        assert rel < 0.01


def _paged(
    seqs: list[torch.Tensor], block_size: int, num_blocks: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter each sequence's ``[len, KV, D]`` rows into shuffled blocks of a cache."""
    kv, d = seqs[0].shape[1:]
    cache = torch.randn(num_blocks, block_size, kv, d, generator=gen)  # garbage elsewhere
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-len(s) // block_size) for s in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int64)
    for i, s in enumerate(seqs):
        for b in range(-(-len(s) // block_size)):
            block = free.pop()
            tables[i, b] = block
            chunk = s[b * block_size : (b + 1) * block_size]
            cache[block, : len(chunk)] = chunk
    return cache, tables


def _paged_int8(
    seqs: list[torch.Tensor], block_size: int, num_blocks: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`_paged` for an int8 cache: the cache, its scales ``[blocks, block_size, KV]``,
    the tables, and each sequence as the cache holds it (``q * scale``)."""
    rows = [native.quantize_kv_rows(s) for s in seqs]
    cache, tables = _paged(
        [q.float() for q, _ in rows], block_size, num_blocks, torch.Generator().manual_seed(seed)
    )
    scales = torch.rand(num_blocks, block_size, seqs[0].shape[1])  # garbage elsewhere
    for i, (_, s) in enumerate(rows):
        for b in range(-(-len(s) // block_size)):
            chunk = s[b * block_size : (b + 1) * block_size]
            scales[tables[i, b], : len(chunk)] = chunk
    held = [q.float() * s[..., None] for q, s in rows]
    return cache.clamp(-127, 127).to(torch.int8), scales, tables, held


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 40), (8, 1, 16)])
def test_paged_decode_attention_matches_sdpa(
    kernels: native.Kernels,
    heads: int,
    kv_heads: int,
    head_dim: int,
    cache_dtype: torch.dtype,
    window: int | None,
) -> None:
    """With a sliding ``window`` (Gemma 3), the query sees only its last ``window``
    positions: contexts below, at and above it, and windows that start mid-block."""
    gen = torch.Generator().manual_seed(heads)
    # One position, part of a block, block edges, and contexts of one, two, three and
    # sixteen chunks of 64 positions (the chunks are merged in a second pass).
    lengths = [1, 5, 16, 17, 64, 65, 100, 150, 1000]
    # Values a float16 cache holds exactly, so both float cache types have one reference.
    keys = [torch.randn(n, kv_heads, head_dim, generator=gen).half().float() for n in lengths]
    values = [torch.randn(n, kv_heads, head_dim, generator=gen).half().float() for n in lengths]
    scales: native.KVScales | None = None
    if cache_dtype == torch.int8:
        # int8: the reference attends over what the cache holds, each row's q * scale
        k_cache, k_scale, tables, keys = _paged_int8(keys, 16, 120, 7)
        v_cache, v_scale, _, values = _paged_int8(values, 16, 120, 7)  # same tables
        scales = (k_scale, v_scale)
    else:
        k_cache, tables = _paged(keys, 16, 120, torch.Generator().manual_seed(7))
        v_cache, _ = _paged(values, 16, 120, torch.Generator().manual_seed(7))  # same tables
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(head_dim)
    ctx = torch.tensor(lengths, dtype=torch.int64)
    kernels.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, out, scales, window)
    for i, n in enumerate(lengths):
        first = 0 if window is None else max(0, n - window)
        want = F.scaled_dot_product_attention(
            q[i][:, None, :],
            keys[i][first:].transpose(0, 1),
            values[i][first:].transpose(0, 1),
            scale=scale,
            enable_gqa=True,
        )[:, 0]
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.int8])
def test_paged_decode_attention_is_batch_invariant(
    kernels: native.Kernels, cache_dtype: torch.dtype
) -> None:
    """A sequence's attention is bitwise the same alone and beside any other sequences:
    its context is cut into chunks by its own length, never by the batch."""
    gen = torch.Generator().manual_seed(3)
    lengths = [300, 7, 1000, 64, 129]
    keys = [torch.randn(n, 3, 64, generator=gen) for n in lengths]
    values = [torch.randn(n, 3, 64, generator=gen) for n in lengths]
    scales: native.KVScales | None = None
    if cache_dtype == torch.int8:
        k_cache, k_scale, tables, _ = _paged_int8(keys, 16, 120, 5)
        v_cache, v_scale, _, _ = _paged_int8(values, 16, 120, 5)
        scales = (k_scale, v_scale)
    else:
        k_cache, tables = _paged(keys, 16, 120, torch.Generator().manual_seed(5))
        v_cache, _ = _paged(values, 16, 120, torch.Generator().manual_seed(5))
        k_cache, v_cache = k_cache.half(), v_cache.half()
    q = torch.randn(len(lengths), 9, 64, generator=gen)
    ctx = torch.tensor(lengths, dtype=torch.int64)
    batch = torch.empty_like(q)
    kernels.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, batch, scales)
    for i in range(len(lengths)):
        alone = torch.empty(1, 9, 64)
        kernels.paged_decode_attention(
            q[i : i + 1],
            k_cache,
            v_cache,
            tables[i : i + 1].contiguous(),
            ctx[i : i + 1],
            0.125,
            alone,
            scales,
        )
        assert torch.equal(alone[0], batch[i]), lengths[i]


def test_kv_kind_needs_scales_exactly_for_int8() -> None:
    scales = (torch.zeros(2, 1), torch.zeros(2, 1))
    assert native.kv_kind(torch.zeros(2, 1, 4)) == native.KV_F32
    assert native.kv_kind(torch.zeros(2, 1, 4, dtype=torch.float16)) == native.KV_F16
    assert native.kv_kind(torch.zeros(2, 1, 4, dtype=torch.int8), scales) == native.KV_I8
    with pytest.raises(TypeError, match="without scales"):
        native.kv_kind(torch.zeros(2, 1, 4, dtype=torch.int8))
    with pytest.raises(TypeError, match="with scales"):
        native.kv_kind(torch.zeros(2, 1, 4), scales)
    with pytest.raises(TypeError, match="bfloat16"):
        native.kv_kind(torch.zeros(2, 1, 4, dtype=torch.bfloat16))


def test_add_rmsnorm(kernels: native.Kernels) -> None:
    torch.manual_seed(2)
    x = torch.randn(5, 100) * 3
    h = torch.randn(5, 100)
    w = torch.randn(100)
    out = torch.empty(5, 100)
    before = x.clone()
    kernels.add_rmsnorm(x, None, w, 1e-5, out)
    assert torch.equal(x, before)
    torch.testing.assert_close(out, F.rms_norm(before, (100,), w, 1e-5))
    kernels.add_rmsnorm(x, h, w, 1e-5, out)
    torch.testing.assert_close(x, before + h)
    torch.testing.assert_close(out, F.rms_norm(before + h, (100,), w, 1e-5))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
def test_rope_store(kernels: native.Kernels, cache_dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    tokens, heads, kv_heads, dim = 6, 4, 2, 8
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    angles = torch.rand(tokens, dim // 2) * 10
    cos = torch.cat((angles, angles), -1).cos()
    sin = torch.cat((-angles.sin(), angles.sin()), -1)
    slots = torch.tensor([9, 2, 0, 7, 4, 11])
    k_cache = torch.zeros(12, kv_heads, dim, dtype=cache_dtype)
    v_cache = torch.zeros(12, kv_heads, dim, dtype=cache_dtype)
    scales = None
    if cache_dtype == torch.int8:
        qkv[1, -dim:] = 0  # a row of zeros: scale 0
        scales = (torch.zeros(12, kv_heads), torch.zeros(12, kv_heads))
    q_out = torch.empty(tokens, heads, dim)
    k_out = torch.empty(tokens, kv_heads, dim)
    kernels.rope_store(qkv, cos, sin, slots, k_cache, v_cache, q_out, k_out, scales)

    def rotate(x: torch.Tensor) -> torch.Tensor:  # Hugging Face's apply_rotary_pos_emb
        x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
        c = torch.cat((angles, angles), -1).cos()[:, None]
        s = torch.cat((angles, angles), -1).sin()[:, None]
        return x * c + torch.cat((-x2, x1), -1) * s

    heads_all = qkv.view(tokens, heads + 2 * kv_heads, dim)
    torch.testing.assert_close(q_out, rotate(heads_all[:, :heads]))
    torch.testing.assert_close(k_out, rotate(heads_all[:, heads : heads + kv_heads]))
    untouched = [i for i in range(12) if i not in slots.tolist()]
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    v_in = heads_all[:, heads + kv_heads :]
    if scales is None:
        # float16 caches hold exactly torch's round-to-nearest-even of the float32 values
        assert torch.equal(k_cache[slots], k_out.to(cache_dtype))
        assert torch.equal(v_cache[slots], v_in.to(cache_dtype))
        return
    # int8: the bytes and scales of quantize_kv_rows (the torch path stores the same)
    for cache, scale, x in ((k_cache, scales[0], k_out), (v_cache, scales[1], v_in)):
        want_q, want_s = native.quantize_kv_rows(x)
        assert torch.equal(cache[slots], want_q) and torch.equal(scale[slots], want_s)
        assert not scale[untouched].any()
        assert int(cache[slots].abs().amax(dim=-1).min()) in (0, 127)  # each row's max is 127
        err = (cache[slots].float() * scale[slots][..., None] - x).abs()
        assert bool((err <= scale[slots][..., None] / 2 + 1e-7).all())  # half a step at most
    assert float(scales[1][slots[1], -1]) == 0.0  # the row of zeros (last value head)


def test_float16_conversions_match_torch(kernels: native.Kernels) -> None:
    """Round to nearest even, subnormals, overflow, infinities, NaN: as torch (the plain-C
    build converts in software, the others with F16C)."""
    torch.manual_seed(5)
    special = [0.0, -0.0, 1.0, 65504.0, 65520.0, 1e6, -1e6, 6.1e-5, 5.96e-8, 2.98e-8, 1e-9]
    ties = [1 + 2**-11, 1 + 3 * 2**-11, 2048 + 1.0, 2048 + 3.0]  # halfway cases
    x = torch.cat(
        [
            torch.tensor(special + ties + [float("inf"), float("-inf")]),
            torch.randn(5000) * torch.logspace(-9, 5, 5000),
        ]
    )
    assert torch.equal(kernels.f32_to_f16(x), x.half())
    h = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    back, want = kernels.f16_to_f32(h), h.float()
    assert torch.equal(back.isnan(), want.isnan())
    assert torch.equal(back[~want.isnan()], want[~want.isnan()])
    assert kernels.f32_to_f16(torch.tensor([float("nan")])).isnan().all()


def test_silu_mul(kernels: native.Kernels) -> None:
    torch.manual_seed(4)
    gate_up = torch.randn(3, 2 * 50) * 4
    out = torch.empty(3, 50)
    kernels.silu_mul(gate_up, out)
    torch.testing.assert_close(out, F.silu(gate_up[:, :50]) * gate_up[:, 50:])


def test_silu_mul_vector_exp_over_the_whole_range(kernels: native.Kernels) -> None:
    """The vectorized exp (Cephes' polynomial) against float64, gates from -100 to 100."""
    gate = torch.linspace(-100, 100, 4099)
    gate_up = torch.cat([gate, torch.ones(4099)])[None]
    out = torch.empty(1, 4099)
    kernels.silu_mul(gate_up, out)
    want = F.silu(gate.double())
    close = (out[0].double() - want).abs() <= 1e-6 * want.abs() + 1e-30
    assert bool(close.all()), gate[~close][:5]


def _q8_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation rounding, in torch: per row and group of ``group``, codes
    ``round(x * 127 / max|x|)`` times ``max|x| / 127`` (float32, as the kernel computes),
    and the group sums of the exact ``x``."""
    m, k = x.shape
    g = x.reshape(m, k // group, group)
    amax = g.abs().amax(dim=2, keepdim=True)
    codes = torch.round(g * (127.0 / amax)).nan_to_num(0.0)
    return (codes * (amax / 127.0)).reshape(m, k), g.sum(dim=2)


def _q4_reference(
    x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``sum_g d s (q . a) + m sum(x)``: the dequantized weights against the rounded
    activations, with the minimum's term on the exact group sums (as the kernel does)."""
    rounded, sums = _q8_activations(x, 32)
    scaled = (q.double().reshape(q.shape[0], -1, 32) * d.double()[..., None]).reshape(q.shape)
    y = rounded.double() @ scaled.T + sums.double() @ m.double().T
    return (y if bias is None else y + bias.double()).float()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (7, 32), (1000, 576)])
def test_q4_linear_matches_reference(
    kernels: native.Kernels, rows: int, out_features: int, in_features: int
) -> None:
    torch.manual_seed(rows * out_features + in_features)
    q, d, m = quantize_q4(torch.randn(out_features, in_features))
    packed = kernels.pack_q4(q, d, m)
    x = (
        torch.randn(rows, in_features)
        * torch.logspace(-2, 2, in_features)[torch.randperm(in_features)]
    )
    for bias in (None, torch.randn(out_features)):
        out = torch.empty(rows, out_features)
        kernels.grouped_linear(4, x, packed, bias, out)
        want = _q4_reference(x, q, d, m, bias)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4 * float(want.abs().max()))


def test_q4_linear_zero_groups_and_rows(kernels: native.Kernels) -> None:
    """All-zero activation groups (scale 0) contribute nothing; a zero row gives the bias."""
    torch.manual_seed(3)
    q, d, m = quantize_q4(torch.randn(70, 96))
    x = torch.randn(3, 96)
    x[0] = 0.0
    x[1, 32:64] = 0.0
    bias = torch.randn(70)
    out = torch.empty(3, 70)
    kernels.grouped_linear(4, x, kernels.pack_q4(q, d, m), bias, out)
    assert torch.equal(out[0], bias)
    torch.testing.assert_close(out, _q4_reference(x, q, d, m, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_linear_rows_are_batch_invariant(kernels: native.Kernels, bits: int) -> None:
    """A row's output is bitwise the same alone and at any place in any batch: its
    activation codes, scales and sums come from the row alone."""
    torch.manual_seed(bits)
    w = torch.randn(1030, 576)
    packed = kernels.pack_q4(*quantize_q4(w)) if bits == 4 else kernels.pack_q8(*quantize_q8(w))
    x = torch.randn(1, 576)
    alone = torch.empty(1, 1030)
    kernels.grouped_linear(bits, x, packed, None, alone)
    for neighbours in (1, 2, 3, 4, 6, 7, 9, 15, 20, 31):
        others = torch.randn(neighbours, 576) * torch.logspace(-3, 3, neighbours)[:, None]
        for at in (0, 1, neighbours // 2, neighbours):
            batch = torch.cat([others[:at], x, others[at:]])
            out = torch.empty(len(batch), 1030)
            kernels.grouped_linear(bits, batch, packed, None, out)
            assert torch.equal(out[at], alone[0]), (neighbours, at)


def test_q4_packing_refuses_ragged_groups(kernels: native.Kernels) -> None:
    q, d, m = quantize_q4(torch.randn(8, 64))
    with pytest.raises(ValueError, match="divisible by 32"):
        kernels.pack_q4(q[:, :40], d, m)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (7, 32), (1000, 576)])
def test_q8_linear_matches_reference(
    kernels: native.Kernels, rows: int, out_features: int, in_features: int
) -> None:
    """Q8_0 weights against the same rounded activations: integer products, exact."""
    torch.manual_seed(rows * out_features + in_features + 1)
    q, d = quantize_q8(torch.randn(out_features, in_features))
    packed = kernels.pack_q8(q, d)
    x = torch.randn(rows, in_features)
    x[0, :32] = 0.0  # an all-zero group
    rounded, _ = _q8_activations(x, 32)
    for bias in (None, torch.randn(out_features)):
        out = torch.empty(rows, out_features)
        kernels.grouped_linear(8, x, packed, bias, out)
        want = rounded.double() @ dequantize_q8(q, d).double().T
        want = (want if bias is None else want + bias.double()).float()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


def test_native_q4_linear_layer(kernels: native.Kernels) -> None:
    torch.manual_seed(1)
    w = dequantize_q4(*quantize_q4(torch.randn(300, 192) * 0.05))  # already on the 4-bit grid
    b = torch.randn(300)
    layer = NativeQ4Linear(w, b, kernels)
    for rows in (1, 9, 70):
        x = torch.randn(2, rows, 192)
        got = layer(x)
        assert got.shape == (2, rows, 300)
        # only the activations are rounded (8 bits per group of 32): close to the float layer
        rel = float((got - F.linear(x, w, b)).norm() / F.linear(x, w, b).norm())
        assert rel < 0.01


def test_argmax_rows(kernels: native.Kernels) -> None:
    x = torch.randn(5, 1003, generator=torch.Generator().manual_seed(8))
    x[1, 3] = x[1, 700] = 99.0
    x[2, 500] = float("nan")
    x[3, 2] = float("inf")
    x[4] = float("-inf")
    assert torch.equal(kernels.argmax_rows(x), x.argmax(-1))
