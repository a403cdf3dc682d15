"""The model runner: executes an immutable :class:`~furnace_trio.core.plan.StepPlan`.

It owns the torch side of serving: the :class:`~furnace_trio.runtime.model.Transformer`, the paged
:class:`~furnace_trio.runtime.kv_cache.KVCache`, and the per-sequence sampler generators. It never
decides what to schedule; the engine calls :meth:`ModelRunner.step` on a worker thread.

Thread-local torch state (inference mode, the CUDA device) is set inside every call, since
Trio retires idle worker threads and a step may land on a fresh one.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from furnace_trio.core.plan import ChunkPlan, SampledToken, SampleSpec, StepPlan
from furnace_trio.loading.loader import LoadedModel
from furnace_trio.loading.model_config import ModelConfig, UnsupportedModelError, fit_context
from furnace_trio.runtime import native
from furnace_trio.runtime.build import WeightBuilder
from furnace_trio.runtime.cuda_graphs import DecodeGraphs
from furnace_trio.runtime.kv_cache import KVCache
from furnace_trio.runtime.model import Transformer
from furnace_trio.runtime.moe import ExpertCounter
from furnace_trio.runtime.native.config import DEFAULT_NATIVE_CONFIG, NativeConfig
from furnace_trio.runtime.quant import resolve_quantization
from furnace_trio.runtime.sampling import GeneratorStore, sample, token_logprobs
from furnace_trio.runtime.step_inputs import build_inputs
from furnace_trio.runtime.verification import accept_drafts, draft_specs

if TYPE_CHECKING:
    from furnace_trio.runtime.draft import Drafter

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
#: Prompt positions scored at a time (see ModelRunner._score).
SCORE_ROWS = 256
#: The KV cache dtypes a runner takes (see RunnerConfig.kv_dtype).
KV_DTYPES = ("auto", "model", "float16", "int8")


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` picks CUDA when available, else the CPU; a CUDA device always gets its index."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    if device.type == "cuda" and device.index is None:
        # With an index: torch.cuda.set_device (every step, on the model thread) refuses a
        # bare "cuda".
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """float32 on the CPU, bfloat16 on a GPU, unless configured."""
    if name is None or name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(table)}")
    return table[name]


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """How to run a model. ``quantization`` is ``none`` (float reference), ``int8`` (CPU,
    see :mod:`furnace_trio.runtime.quant`), ``q4`` (CPU with the native kernels: Q4_1 groups for
    every layer but the LM head, which gets Q8_0) or ``auto`` (on the CPU the file's own
    weights where they are Q4_1 or Q8_0 values, int8 elsewhere; on a GPU none). The runner
    default is the float reference, the server's default is ``auto``."""

    device: str = "auto"
    dtype: str | None = None
    kv_cache_bytes: int = 1 << 30
    block_size: int = DEFAULT_BLOCK_SIZE
    max_context: int | None = None
    quantization: str = "none"
    # The native CPU kernels (int8 linear, decode attention); False: torch kernels only.
    native: bool = True
    # How the native kernels are built and where they are cached.
    native_build: NativeConfig = DEFAULT_NATIVE_CONFIG
    # KV cache dtype: "auto" is float16 for int8 / q4 with the native kernels (half the bytes
    # that decode attention reads, and twice the tokens per MB), else the model dtype;
    # "model" always keeps the model dtype, "float16" is float16 whatever the runtime;
    # "int8" stores int8 with one float32 scale per token and KV head: 1.9 times a float16
    # cache's tokens per MB (on the default model no faster and no worse in perplexity;
    # see docs/benchmarks.md).
    kv_dtype: str = "auto"
    # Chunks of up to this many tokens run as one-token rows of the decode path (see
    # build_inputs); None: every chunk where the native attention kernel runs the model,
    # else 0 (0: every chunk of two or more tokens takes the chunk path, for comparisons).
    split_chunks_upto: int | None = None
    # All-decode steps replayed from CUDA graphs (see furnace_trio.runtime.cuda_graphs). None: on a
    # CUDA device. True on the CPU runs the same padded static-buffer step eagerly (what the
    # tests check without a GPU); the native CPU kernels never take it.
    cuda_graphs: bool | None = None
    # Build the model's multi-token-prediction layer and its KV cache (speculative decoding
    # with FURNACE_SPECULATIVE=mtp; runtime/mtp.py); a model without one is an error.
    mtp: bool = False


class ModelRunner:
    """Runs steps of one model on one device; implements the ``StepRunner`` protocol."""

    def __init__(
        self, config: ModelConfig, weights: Mapping[str, torch.Tensor], settings: RunnerConfig
    ) -> None:
        """Build the model from ``weights`` (the loader's records, read and converted one
        tensor at a time, or a mapping of float tensors) and allocate the KV cache."""
        self.device = resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, self.device)
        limit = config.max_position_embeddings
        self._max_context = min(settings.max_context or limit, limit)
        config = fit_context(config, self._max_context)  # LongRoPE's factors for it
        self.config = config
        mode = resolve_quantization(settings.quantization, self.device)
        if mode != "none" and self.dtype != torch.float32:
            if settings.quantization != "auto":
                raise ValueError(f"{mode} quantization needs dtype float32 (CPU)")
            mode = "none"  # auto: a configured float16/bfloat16 wins
        use_native = settings.native and self.device.type == "cpu"
        kernels = native.load(settings.native_build) if use_native else None
        self._kernels = kernels
        if mode == "q4" and kernels is None:
            logger.warning("runner: 4-bit weights need the native kernels; using int8")
        builder = WeightBuilder(
            weights, device=self.device, dtype=self.dtype, mode=mode, kernels=kernels
        )
        if settings.mtp and not config.mtp_layers:
            raise UnsupportedModelError(
                f"this {config.architecture} model has no multi-token-prediction layers "
                "(MiMo's model.mtp_layers); speculative decoding needs another draft source"
            )
        self.model = Transformer(config, builder, mtp=settings.mtp).eval()
        builder.finish()
        # Tokens per expert of a mixture of experts (None for dense models).
        self._experts = ExpertCounter.attach(self.model)
        # What the linear layers run: none, int8, or q4 (some or all in 4-bit groups).
        self.quantization = "none" if mode == "none" else "int8"
        if mode != "none":
            counts = dict(builder.counts)
            if counts["q4"]:
                self.quantization = "q4"
            others = "".join(
                f", {n} {kind.upper()}"
                for kind, n in counts.items()
                if kind not in ("q4", "q8", "int8")
            )
            logger.info(
                "runner: linear layers quantized: %d 4-bit (Q4_1), %d Q8_0, %d int8%s (%s)",
                counts["q4"],
                counts["q8"],
                counts["int8"],
                others,
                "fbgemm" if kernels is None else "native",
            )
        if self.dtype == torch.float32:
            self.model.use_native(kernels)
        # With the native attention kernel every chunk runs as one-token rows of the decode
        # path (see build_inputs): one kernel path and one accumulation order for every
        # position, so a position's logits are bitwise the same however its prompt was split
        # between the prefix cache and computation, into chunks, or among other sequences.
        split = sys.maxsize if self.model.attends_natively else 0
        self._split_upto = (
            split if settings.split_chunks_upto is None else settings.split_chunks_upto
        )
        if settings.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {settings.kv_dtype!r}"
            )
        half_kv = settings.kv_dtype == "auto" and self.quantization != "none" and kernels
        if settings.kv_dtype in ("float16", "int8"):
            self.kv_dtype = getattr(torch, settings.kv_dtype)
        else:
            self.kv_dtype = torch.float16 if half_kv else self.dtype
        per_block = KVCache.bytes_per_block(config, settings.block_size, self.kv_dtype)
        # The multi-token-prediction layer's cache: one layer more under the same blocks.
        mtp_config = None
        if self.model.mtp is not None:
            mtp_config = dataclasses.replace(config, num_layers=1, sliding_layers=(), moe=None)
            per_block += KVCache.bytes_per_block(mtp_config, settings.block_size, self.kv_dtype)
        num_blocks = max(1, settings.kv_cache_bytes // per_block)
        graphs = settings.cuda_graphs
        if graphs is None:
            graphs = self.device.type == "cuda"
        # Routing reads its counts on the host every layer: never inside a graph.
        # The multi-token-prediction layer reads each step's hidden states: no graphs either.
        graphs = graphs and kernels is None and config.moe is None and self.model.mtp is None
        # With graphs, one block more than the engine gets: the padding rows' scratch block.
        self._num_blocks = num_blocks
        self.cache = KVCache(
            config,
            num_blocks=num_blocks + (1 if graphs else 0),
            block_size=settings.block_size,
            dtype=self.kv_dtype,
            device=self.device,
        )
        #: The multi-token-prediction layer's KV cache (runtime/mtp.py), where it is built.
        self.mtp_cache: KVCache | None = None
        if mtp_config is not None:
            self.mtp_cache = KVCache(
                mtp_config,
                num_blocks=num_blocks,
                block_size=settings.block_size,
                dtype=self.kv_dtype,
                device=self.device,
            )
        self.graphs: DecodeGraphs | None = None
        if graphs:
            self.graphs = DecodeGraphs(
                self.model,
                self.cache,
                max_context=self._max_context,
                scratch_block=num_blocks,
                capture=self.device.type == "cuda",
            )
        self.generators = GeneratorStore(self.device)
        #: Speculative decoding's draft source on the model thread (a draft model,
        #: runtime/draft.py, or the multi-token-prediction layer, runtime/mtp_draft.py): it
        #: replaces the drafts of every drafted chunk with its own proposals before the
        #: forward pass, and sees each step's verified tokens after it.
        self.drafter: Drafter | None = None
        # Scores of prompts being prefilled, by prompt sequence (see ChunkPlan.score_ids).
        self._prompt_scores: dict[int, list[SampledToken]] = {}
        logger.info(
            "runner: %s on %s/%s (%s), %d KV blocks of %d tokens (%s, %.0f MiB), context %d",
            config.architecture,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.quantization,
            num_blocks,
            settings.block_size,
            str(self.kv_dtype).removeprefix("torch."),
            num_blocks * per_block / 2**20,
            self._max_context,
        )

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, settings: RunnerConfig) -> ModelRunner:
        return cls(loaded.config, loaded.weights, settings)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def num_blocks(self) -> int:
        """The KV blocks the engine may hand out (without the graphs' scratch block)."""
        return self._num_blocks

    @property
    def max_context(self) -> int:
        return self._max_context

    def step(self, plan: StepPlan) -> list[SampledToken]:
        """Copy blocks, run the forward pass, draw the samples (blocking)."""
        with torch.inference_mode():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            for seq_id in plan.released:
                self.generators.release(seq_id)
                self._prompt_scores.pop(seq_id, None)
            self.cache.copy_blocks(plan.block_copies)
            if self.mtp_cache is not None:
                self.mtp_cache.copy_blocks(plan.block_copies)
            if self.drafter is not None:
                self.drafter.release(plan.released)
                plan = self.drafter.fill(plan)
            if not plan.chunks:
                return []
            if self._experts is not None:
                self._experts.discard()  # a failed step's partial counts (it runs again)
            logits = None
            graphs = self.graphs
            if graphs is not None and graphs.accepts(plan) and not _scores(plan):
                logits = graphs.run(plan)
            if logits is None:
                logits = self._forward(plan)
            if self._experts is not None:
                self._experts.collect()
            specs: list[SampleSpec] = []
            rows: list[int] = []
            row = 0
            for chunk in plan.chunks:
                if chunk.score_ids:
                    self._score(chunk, logits[row : row + len(chunk.score_ids)])
                    row += len(chunk.score_ids)
                if chunk.num_drafts:
                    specs.extend(draft_specs(chunk))
                    rows.extend(range(row, row + chunk.num_drafts + 1))
                    row += chunk.num_drafts + 1
                elif chunk.samples:
                    specs.extend(chunk.samples)
                    rows.extend([row] * len(chunk.samples))
                    row += 1
            tokens = self._sample(plan, logits, specs, rows) if specs else []
            if self.drafter is not None:
                self.drafter.observe(plan, tokens)
            return tokens

    def _sample(
        self, plan: StepPlan, logits: torch.Tensor, specs: list[SampleSpec], rows: list[int]
    ) -> list[SampledToken]:
        """Draw ``specs``' tokens from their ``rows`` of ``logits`` and verify drafts."""
        if rows != list(range(logits.shape[0])):  # n > 1 samples share their row
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        generators = [self.generators.get(s.seq_id, s.params.seed) for s in specs]
        sampled = sample(logits, specs, generators, self._kernels)
        if self._prompt_scores:  # a scored prompt's first tokens carry its scores
            self._with_prompt_scores(plan, sampled)
        return accept_drafts(plan, sampled, proposed=self.drafter is not None)

    def _score(self, chunk: ChunkPlan, logits: torch.Tensor) -> None:
        """Keep the logprobs of the prompt tokens that ``chunk``'s positions predict (and
        the most likely alternatives), from the model's own distribution, until the
        prompt's samples are drawn. Rows go a slice at a time, so that a long chunk's
        float32 copies stay small (a 4,096-token chunk over a 150,000-token vocabulary
        would take gigabytes at once)."""
        kept = self._prompt_scores.setdefault(chunk.seq_id, [])
        # A scored prompt is computed whole, so ``start_pos`` scores precede this chunk's;
        # more are a failed step's, whose chunks the engine runs again.
        del kept[chunk.start_pos :]
        for at in range(0, len(chunk.score_ids), SCORE_ROWS):
            score_ids = chunk.score_ids[at : at + SCORE_ROWS]
            ids = torch.tensor(score_ids, device=logits.device)
            scores = token_logprobs(
                logits[at : at + SCORE_ROWS].float(), ids, [chunk.score_top] * len(score_ids)
            )
            kept.extend(
                SampledToken(chunk.seq_id, token_id, value, top)
                for token_id, (value, top) in zip(score_ids, scores, strict=True)
            )

    def _with_prompt_scores(self, plan: StepPlan, sampled: list[SampledToken]) -> None:
        """Give the first tokens of scored prompts their prompt's scores (in place)."""
        at = 0
        for chunk in plan.chunks:
            count = len(chunk.samples) + chunk.num_drafts
            first = count and not chunk.samples[0].output_token_ids
            if first and chunk.samples[0].params.prompt_logprobs is not None:
                scores = tuple(self._prompt_scores.pop(chunk.seq_id, ()))
                for i in range(at, at + count):
                    sampled[i] = dataclasses.replace(sampled[i], prompt_logprobs=scores)
            at += count

    def capture_graphs(self, most: int) -> None:
        """With decode graphs: capture every batch size up to ``most`` sequences now (see
        :meth:`DecodeGraphs.warm_up`); without, nothing."""
        if self.graphs is None:
            return
        with torch.inference_mode():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self.graphs.warm_up(most)

    def logits(self, plan: StepPlan) -> torch.Tensor:
        """Next-token logits after every chunk of ``plan``, no sampling (tests, benchmarks)."""
        with torch.inference_mode():
            self.cache.copy_blocks(plan.block_copies)
            logits = self._forward(plan, all_rows=True)
            if self._experts is not None:
                self._experts.discard()  # counts are of served steps only
            return logits

    def expert_tokens(self) -> tuple[tuple[int, ...], ...]:
        """Tokens routed to each expert of each layer by the steps served so far (one tuple
        per layer, empty for dense layers; none at all for a dense model). Safe to call
        from another thread while a step runs: it reads the last step's host copy."""
        return () if self._experts is None else self._experts.snapshot()

    def prompt_logits(self, token_ids: Sequence[int], chunk: int | None = None) -> torch.Tensor:
        """Next-token logits at every position of one sequence, ``[len, vocab]`` float32.

        For perplexity (tests, benchmarks). One prefill step, or with ``chunk`` steps of that
        many tokens, each after the ones before it in the cache: then attention reads the
        cached keys and values, as decoding does (what a quantized KV cache changes). It
        writes the KV cache from block 0 on, so it must not run while an engine is serving
        from this runner.
        """
        n = len(token_ids)
        blocks = tuple(range(-(-n // self.block_size)))
        if n == 0 or len(blocks) > self.num_blocks:
            raise ValueError(f"need 1..{self.num_blocks * self.block_size} tokens, got {n}")
        size = chunk or n
        out = []
        with torch.inference_mode():
            for at in range(0, n, size):
                ids = tuple(token_ids[at : at + size])
                plan = StepPlan((ChunkPlan(0, ids, at, blocks),))
                inputs = build_inputs(
                    plan, self.block_size, self.device, split_upto=self._split_upto
                )
                every = torch.arange(len(ids), dtype=torch.int64, device=self.device)
                inputs = dataclasses.replace(inputs, logit_rows=every)
                out.append(self.model(inputs, self.cache))
            if self._experts is not None:
                self._experts.discard()
        return out[0] if len(out) == 1 else torch.cat(out)

    def _forward(self, plan: StepPlan, *, all_rows: bool = False) -> torch.Tensor:
        inputs = build_inputs(
            plan, self.block_size, self.device, all_rows=all_rows, split_upto=self._split_upto
        )
        return self.model(inputs, self.cache)


def _scores(plan: StepPlan) -> bool:
    """Whether a chunk of ``plan`` scores prompt tokens (never replayed from a graph)."""
    return any(chunk.score_ids for chunk in plan.chunks)
