"""Linear layers on a GGUF tensor's own blocks (runtime.blocks, cpu_kquants.c).

Every type gets random but valid blocks (random code bytes, sane float16 scales) and is
compared with two float64 references computed from ``gguf.quants.dequantize`` of the same
bytes:

- the activations rounded as the kernel rounds them (int8 per row and 32 inputs for Q4_0,
  Q5_0, Q4_1, Q8_0; per 256 for the K-quants), emulated in numpy float32: what is left is
  float32 rounding, so the tolerance is tight (1e-5 of the sum of absolute products) and
  any misplaced code, scale or minimum shows;
- the exact activations: the difference is the activation rounding, at most half a step
  (``max|x| / 254`` of the block) per input, so ``|error| <= sum_k |w_k| * step_k / 2``
  (plus float32 slack) is a bound, not an estimate.

Run on the AVX2 (or AVX-512) build of this machine and on the plain-C build.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from furnace_trio.runtime import native
from furnace_trio.runtime.blocks import BLOCK_FORMATS, BlockLinear, linear_from_blocks

from .native_builds import BUILDS, load_build

TYPES = [T.Q4_0, T.Q5_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)


@pytest.fixture(scope="module", params=list(BUILDS))
def kernels(request: pytest.FixtureRequest) -> native.Kernels:
    return load_build(request.param)


def _f16(rng: np.random.Generator, shape: tuple[int, ...], low: float, high: float) -> np.ndarray:
    """float16 factors in [low, high) as bytes ``[..., 2]``."""
    return rng.uniform(low, high, size=shape).astype(np.float16).view(np.uint8).reshape(*shape, 2)


def random_blocks(
    ggml_type: int, n: int, k: int, rng: np.random.Generator, unit: float = 1.0
) -> np.ndarray:
    """``n`` rows of ``k`` weights of ``ggml_type``: random code and scale bytes, float16
    factors that make weights of about ``unit`` (signed for the symmetric types)."""
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    shape = (n, k // block)
    b = rng.integers(0, 256, size=(*shape, size), dtype=np.uint8)
    if ggml_type in (T.Q4_0, T.Q5_0, T.Q8_0):
        step = {T.Q4_0: 8, T.Q5_0: 16, T.Q8_0: 128}[T(ggml_type)]
        b[..., 0:2] = _f16(rng, shape, -unit / step, unit / step)
    elif ggml_type == T.Q4_1:
        b[..., 0:2] = _f16(rng, shape, 0.05 * unit, 0.15 * unit)
        b[..., 2:4] = _f16(rng, shape, -unit, 0.0)
    elif ggml_type in (T.Q4_K, T.Q5_K):
        levels = 15 if ggml_type == T.Q4_K else 31
        b[..., 0:2] = _f16(rng, shape, 0.5 * unit / (32 * levels), unit / (32 * levels))
        b[..., 2:4] = _f16(rng, shape, 0.5 * unit / 64, unit / 64)
    else:  # Q6_K: d * sc * (q - 32), sc signed bytes
        b[..., 208:210] = _f16(rng, shape, 0.5 * unit / (64 * 32), unit / (64 * 32))
    return b.reshape(-1)


def _dequantize(blocks: np.ndarray, ggml_type: int, n: int) -> np.ndarray:
    return gguf.quants.dequantize(blocks.reshape(n, -1), T(ggml_type)).astype(np.float64)


def _round_activations(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's int8 rounding per row and ``group`` inputs, in float32 as the C code
    does it: ``(s * a, s)`` in float64, ``s`` per input."""
    m, k = x.shape
    g = x.astype(np.float32).reshape(m, k // group, group)
    amax = np.abs(g).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
    a = np.rint(g * inv)
    s = (amax / np.float32(127)).astype(np.float32)
    step = np.broadcast_to(s, g.shape).reshape(m, k).astype(np.float64)
    return (a.astype(np.float64) * s.astype(np.float64)).reshape(m, k), step


def _exact_offsets(blocks: np.ndarray, ggml_type: int, n: int, k: int) -> np.ndarray:
    """The part of each weight the kernel multiplies with the exact activations (Q4_1's
    m); zero for the types whose offsets meet the rounded activations (Q4_0's -8 d, Q5_0's
    -16 d, the K-quants' integer sums)."""
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    raw = blocks.reshape(n, k // block, size)
    if ggml_type == T.Q4_1:
        per_block = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    else:
        return np.zeros((n, k))
    return np.repeat(per_block, block, axis=1)


def _check(module: torch.nn.Module, blocks: np.ndarray, ggml_type: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(ggml_type)
    x = torch.randn(5, k, generator=gen)
    x[1, :7] *= 40.0  # an outlier block
    x[2, :] = 0.0
    got = module(x).double().numpy()
    w = _dequantize(blocks, ggml_type, n)
    offset = _exact_offsets(blocks, ggml_type, n, k)
    xe = x.double().numpy()
    xq, step = _round_activations(x.numpy(), 256 if ggml_type in K_QUANTS else 32)
    # tight: the kernel's own rounding of the activations
    want = xq @ (w - offset).T + xe @ offset.T
    scale = np.abs(xq) @ np.abs(w - offset).T + np.abs(xe) @ np.abs(offset).T
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30)
    # loose: the exact activations, within half a rounding step per input
    exact = xe @ w.T
    bound = (step / 2) @ np.abs(w - offset).T
    assert np.all(np.abs(got - exact) <= 1.001 * bound + 2e-5 * scale + 1e-30)
    assert np.all(got[2] == 0.0)
    assert np.abs(got - exact).max() > 0  # the rounding is there: the test sees int8


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: T(t).name)
def test_matches_dequantized_reference(kernels: native.Kernels, ggml_type: int) -> None:
    rng = np.random.default_rng(ggml_type)
    n, k = 70, 768  # a ragged last panel; 3 super-blocks
    blocks = random_blocks(ggml_type, n, k, rng)
    module = linear_from_blocks(blocks, ggml_type, (n, k), None, kernels)
    assert isinstance(module, BlockLinear)
    assert module.counts_as == BLOCK_FORMATS[ggml_type].counts_as
    assert module.table_row()[0] == BLOCK_FORMATS[ggml_type].table_kind
    _check(module, blocks, ggml_type, n, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    with_bias = linear_from_blocks(blocks, ggml_type, (n, k), bias, kernels)
    assert with_bias is not None
    x = torch.randn(3, k)
    assert torch.allclose(with_bias(x), module(x) + bias, atol=1e-5, rtol=0)


@pytest.mark.parametrize("ggml_type", K_QUANTS, ids=lambda t: T(t).name)
@pytest.mark.parametrize("fill", [0x00, 0xFF], ids=["codes-0", "codes-max"])
def test_k_quant_runs_at_their_bounds(kernels: native.Kernels, ggml_type: int, fill: int) -> None:
    """Every code at 0 or at its largest, every scale at its largest magnitude and every
    rounded activation at +-127: the integer runs reach the ends of their range (Q6_K's
    sub-block sum of x (q - 32) is 32,512 in magnitude per int16 lane), for one row and
    for register blocks of several."""
    rng = np.random.default_rng(fill)
    n, k = 40, 512
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    blocks = np.full((n, k // block, size), fill, dtype=np.uint8)
    if ggml_type == T.Q6_K:  # ql, qh, then signed scales at -128 or 127, then d
        blocks[..., 192:208] = rng.choice(
            np.array([0x80, 0x7F], dtype=np.uint8), (n, k // block, 16)
        )
        blocks[..., 208:210] = _f16(rng, (n, k // block), 1e-4, 2e-4)
    else:  # d, dmin, then 6-bit scales and minimums (all 63 when the bytes are 0xFF)
        blocks[..., 0:2] = _f16(rng, (n, k // block), 1e-4, 2e-4)
        blocks[..., 2:4] = _f16(rng, (n, k // block), 1e-4, 2e-4)
        blocks[..., 4:16] = 0xFF
    blocks = blocks.reshape(-1)
    module = linear_from_blocks(blocks, ggml_type, (n, k), None, kernels)
    assert module is not None
    signs = [
        np.ones(k),
        -np.ones(k),
        np.resize([1.0, -1.0], k),
        np.resize([1.0, 1.0, -1.0, -1.0], k),
    ]
    x = np.stack([signs[i % 4] * (1 + i) for i in range(9)]).astype(np.float32)
    w = _dequantize(blocks, ggml_type, n)
    xq, _ = _round_activations(x, 256)
    assert np.allclose(np.abs(xq), np.abs(x), rtol=1e-6, atol=0)  # every code +-127
    want = xq @ w.T
    scale = np.abs(xq) @ np.abs(w).T
    for rows in (slice(None), slice(0, 1), slice(3, 4)):  # register blocks; one row
        got = module(torch.from_numpy(x[rows])).double().numpy()
        assert np.all(np.abs(got - want[rows]) <= 1e-5 * scale[rows] + 1e-30)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: T(t).name)
def test_rows_are_batch_invariant(kernels: native.Kernels, ggml_type: int) -> None:
    """A row's output alone equals (bitwise) its output in batches of 7 and 33."""
    rng = np.random.default_rng(10 + ggml_type)
    n, k = 100, 512
    blocks = random_blocks(ggml_type, n, k, rng)
    module = linear_from_blocks(blocks, ggml_type, (n, k), None, kernels)
    assert module is not None
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(4))
    whole = module(x)
    seven = module(x[:7])
    for i in (0, 3, 6):
        alone = module(x[i : i + 1])
        assert torch.equal(alone[0], seven[i])
        assert torch.equal(alone[0], whole[i])
    assert torch.equal(module(x[20:21])[0], whole[20])


@pytest.mark.parametrize(
    "flags",
    [
        ("-DKQ_VECS=1",),
        ("-DKQ_VECS=4", "-DKQ_ROWS=2"),
        ("-DKQ_ROWS=3",),
        ("-DKQ_ROWS=4", "-DKQ_VECS=2"),
        ("-DKQ_ROWS=4", "-DKQ_VECS=4"),
        ("-DKQ_ROWS=6", "-DKQ_VECS=2"),
    ],
    # the last three: the builds' choices on Zen 4, Zen 5 and Intel (native/library.py)
    ids=[
        "one-vector",
        "whole-panel",
        "three-rows",
        "four-rows",
        "four-rows-whole-panel",
        "six-rows",
    ],
)
def test_k_quant_register_blockings_agree(flags: tuple[str, ...]) -> None:
    """The K-quant kernels' other register blockings (``-D`` switches for measurements)
    give bitwise the outputs of the default one, for one row and for several."""
    default = load_build("native")
    other = native.load(extra_flags=flags)
    assert other is not None
    rng = np.random.default_rng(7)
    n, k = 70, 512
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(5))
    for ggml_type in K_QUANTS:
        blocks = random_blocks(ggml_type, n, k, rng)
        a = linear_from_blocks(blocks, ggml_type, (n, k), None, default)
        b = linear_from_blocks(blocks, ggml_type, (n, k), None, other)
        assert a is not None and b is not None
        assert torch.equal(a(x), b(x))
        assert torch.equal(a(x[:1]), b(x[:1]))


def test_packing_matches_the_q4_1_and_q8_0_kernels(kernels: native.Kernels) -> None:
    """Q4_1 and Q8_0 blocks pack into exactly the panels pack_q4 / pack_q8 make from the
    same codes (no float round trip)."""
    rng = np.random.default_rng(7)
    n, k = 45, 96
    for ggml_type in (T.Q4_1, T.Q8_0):
        blocks = random_blocks(ggml_type, n, k, rng)
        raw = blocks.reshape(n, k // 32, -1)
        if ggml_type == T.Q4_1:
            qs = raw[..., 4:]
            codes = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n, k)
            d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0])
            m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0])
            expected = kernels.pack_q4(torch.from_numpy(codes.astype(np.uint8)), d, m)
        else:
            codes = raw[..., 2:].view(np.int8).reshape(n, k)
            d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0])
            expected = kernels.pack_q8(torch.from_numpy(codes.copy()), d)
        packed = kernels.pack_blocks(ggml_type, blocks, n, k)
        assert torch.equal(packed, expected.reshape(-1))


def test_fallbacks_and_errors(kernels: native.Kernels) -> None:
    rng = np.random.default_rng(8)
    # K-quants need whole super-blocks of 256: anything else is None, never wrong numbers
    for ggml_type in K_QUANTS:
        assert linear_from_blocks(np.zeros(0, np.uint8), ggml_type, (4, 320), None, kernels) is None
        assert kernels.kq_packed_size(ggml_type, 4, 320) == 0
    # the 32-groups take 320 (and 96), and compute it right
    for ggml_type in (T.Q4_0, T.Q5_0):
        blocks = random_blocks(ggml_type, 9, 96, rng)
        module = linear_from_blocks(blocks, ggml_type, (9, 96), None, kernels)
        assert module is not None
        _check(module, blocks, ggml_type, 9, 96)
    # types without a kernel, and no kernels at all
    assert linear_from_blocks(np.zeros(84 * 4, np.uint8), T.Q2_K, (4, 256), None, kernels) is None
    blocks = random_blocks(T.Q4_K, 4, 256, rng)
    assert linear_from_blocks(blocks, T.Q4_K, (4, 256), None, None) is None
    with pytest.raises(ValueError, match="expected 576 bytes"):
        linear_from_blocks(blocks[:-1], T.Q4_K, (4, 256), None, kernels)


def test_from_a_read_only_memory_map(kernels: native.Kernels, tmp_path: Path) -> None:
    """The loader's case: a slice of a read-only np.memmap; the module keeps no reference."""
    rng = np.random.default_rng(9)
    n, k = 64, 512
    blocks = random_blocks(T.Q6_K, n, k, rng)
    path = tmp_path / "tensor.bin"
    head = b"\x07" * 32
    path.write_bytes(head + blocks.tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    view = mapped[len(head) :]
    assert not view.flags.writeable
    module = linear_from_blocks(view, T.Q6_K, (n, k), None, kernels)
    assert module is not None
    ref = weakref.ref(mapped)
    del view, mapped
    gc.collect()
    assert ref() is None
    x = torch.randn(2, k)
    direct = linear_from_blocks(blocks, T.Q6_K, (n, k), None, kernels)
    assert direct is not None
    assert torch.equal(module(x), direct(x))


# Per layer: the types of the fused qkv, o, fused gate/up and down projections.
LAYER_TYPES = [(T.Q4_K, T.Q5_K, T.Q4_K, T.Q6_K), (T.Q4_0, T.Q6_K, T.Q5_0, T.Q5_K)]


def test_decode_layers_with_block_linears(tmp_path: Path) -> None:
    """A model whose linears are all GGUF blocks (every new type) runs all-decode steps
    through ``furnace_decode_layers``: bitwise the per-op path, and close to the float
    runtime on the dequantized weights."""
    import transformers

    from furnace_trio.core.plan import ChunkPlan, StepPlan
    from furnace_trio.loading.hf_loader import load_hf_directory
    from furnace_trio.runtime.runner import ModelRunner, RunnerConfig

    hf = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(hf).save_pretrained(tmp_path / "m")
    config, lazy = load_hf_directory(tmp_path / "m")
    weights = {name: lazy[name] for name in lazy}
    rng = np.random.default_rng(11)
    modules: list[dict[str, BlockLinear]] = []
    for i, types in enumerate(LAYER_TYPES):
        prefix = f"model.layers.{i}."
        groups = {
            "qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            "o": ["self_attn.o_proj"],
            "gate_up": ["mlp.gate_proj", "mlp.up_proj"],
            "down": ["mlp.down_proj"],
        }
        built = {}
        for (fused, names), ggml_type in zip(groups.items(), types, strict=True):
            parts = []
            for name in names:
                n, k = weights[prefix + name + ".weight"].shape
                unit = 1.0 / np.sqrt(k)
                parts.append(random_blocks(ggml_type, n, k, rng, unit))
                values = _dequantize(parts[-1], ggml_type, n)
                weights[prefix + name + ".weight"] = torch.from_numpy(values).float()
            rows = sum(weights[prefix + name + ".weight"].shape[0] for name in names)
            # rows are independent in GGUF: a fused weight is its parts' bytes in a row
            module = linear_from_blocks(
                np.concatenate(parts), ggml_type, (rows, k), None, native.load()
            )
            assert isinstance(module, BlockLinear)
            built[fused] = module
        modules.append(built)

    def make(quantization: str) -> ModelRunner:
        settings = RunnerConfig(
            device="cpu", kv_cache_bytes=1 << 22, block_size=4, quantization=quantization
        )
        return ModelRunner(config, dict(weights), settings)

    runner, reference = make("int8"), make("none")
    for layer, built in zip(runner.model.layers, modules, strict=True):
        layer.self_attn.qkv_proj = built["qkv"]
        layer.self_attn.o_proj = built["o"]
        layer.mlp.gate_up_proj = built["gate_up"]
        layer.mlp.down_proj = built["down"]
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (6, 13, 2)]
    tables = [tuple(range(16 * i, 16 * i + 16)) for i in range(len(seqs))]
    prompts = StepPlan(tuple(ChunkPlan(i, tuple(s[:-1]), 0, tables[i]) for i, s in enumerate(seqs)))
    decodes = StepPlan(
        tuple(ChunkPlan(i, (s[-1],), len(s) - 1, tables[i]) for i, s in enumerate(seqs))
    )
    prefill = runner.logits(prompts)
    want_prefill = reference.logits(prompts)
    assert float((prefill - want_prefill).norm() / want_prefill.norm()) < 0.03
    kernels = runner.model.kernels
    assert kernels is not None
    table = runner.model._decode_layer_ptrs(runner.cache, kernels)
    assert table is not None
    kinds = table.view(len(LAYER_TYPES), -1)[:, [0, 4, 8, 12]]
    expected = [[BLOCK_FORMATS[t].table_kind for t in types] for types in LAYER_TYPES]
    assert kinds.tolist() == expected
    fused = runner.logits(decodes)
    runner.model.fused_decode = False
    assert torch.equal(fused, runner.logits(decodes))
    want = reference.logits(decodes)
    assert float((fused - want).norm() / want.norm()) < 0.03
