"""Build what the HTTP layer serves: model -> runner -> engine, from a :class:`ServerConfig`.

:func:`load_backend` blocks for as long as loading the model takes; the app calls it in a
worker thread before serving.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from furnace_trio.core.plan import ChunkPlan, StepPlan, StepRunner
from furnace_trio.engine import Engine, EngineConfig, SpeculationConfig
from furnace_trio.engine.model_thread import ModelThread
from furnace_trio.loading.generation_defaults import NO_GENERATION_DEFAULTS, GenerationDefaults
from furnace_trio.loading.model_config import UnsupportedModelError
from furnace_trio.loading.tokenizer import Tokenizer
from furnace_trio.server.config import ServerConfig
from furnace_trio.server.config_env import draft_model_path
from furnace_trio.tools.grammar import GrammarCompiler

if TYPE_CHECKING:
    from furnace_trio.loading.loader import LoadedModel
    from furnace_trio.runtime.draft import DraftModel
    from furnace_trio.runtime.runner import ModelRunner, RunnerConfig

logger = logging.getLogger(__name__)

#: Batch limits when none are configured: a CPU's step time grows with every sequence, so
#: fewer run at once than on a GPU, whose step barely grows until the batch is large. On
#: the CPU, 32: with 32 concurrent streams of the default model, a limit of 16 leaves half
#: of them queued behind whole generations, with a higher TTFT and less throughput; the
#: price is each stream's ITL, which doubles when 32 decode instead of 16 (the figures are
#: in docs/history.md).
DEFAULT_LIMITS = {"cpu": (32, 512), "cuda": (128, 4096)}

#: KV memory when none is configured: 46,592 tokens with the default model on a CPU (its
#: float16 cache), enough for 32 streams of 1,400 tokens; on a GPU the default grows with
#: the device's free memory. Admission reserves a request's worst case (prompt +
#: ``max_tokens``), so longer requests run fewer at once.
DEFAULT_KV_CACHE_MB_CPU = 1024
GPU_KV_FRACTION = 0.5


@dataclass(slots=True)
class Backend:
    """What the routes serve from: the engine, the tokenizer, the model's public name and
    context, the model's sampling defaults (applied to what a request leaves unset),
    ``FURNACE_MAX_OUTPUT_TOKENS`` (``None``: no cap; a reload changes it), ``grammar``, built
    with the model (see :meth:`GrammarCompiler.warm`; ``None`` builds it on the first grammar
    request), and the device type whose defaults :func:`engine_config` fills in."""

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    max_context: int
    generation: GenerationDefaults = NO_GENERATION_DEFAULTS
    max_output_tokens: int | None = None
    grammar: GrammarCompiler | None = None
    device_type: str = "cpu"


def _kv_cache_bytes(config: ServerConfig, device_type: str) -> int:
    if config.kv_cache_mb is not None:
        return config.kv_cache_mb << 20
    if device_type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free * GPU_KV_FRACTION)
    return DEFAULT_KV_CACHE_MB_CPU << 20


def warm_up(runner: ModelRunner, max_running: int) -> None:
    """Run one small prefill and decode before serving, and on a GPU capture the decode
    graphs of every batch size up to ``max_running`` (at the narrowest context width).

    The first calls of a fresh process pay for lazy kernel selection and thread-pool start;
    without this the first client's time to first token is several times the usual. The
    cache slots written here belong to no sequence and are overwritten before being read.
    """
    table = tuple(range(min(runner.num_blocks, -(-9 // runner.block_size))))
    runner.logits(StepPlan((ChunkPlan(0, (0,) * 8, 0, table),)))
    runner.logits(StepPlan((ChunkPlan(0, (0,), 8, table),)))
    runner.capture_graphs(max_running)


def engine_config(config: ServerConfig, device_type: str) -> EngineConfig:
    """The engine's settings: the server's, with the device's defaults for what it left unset."""
    max_running, max_step_tokens = DEFAULT_LIMITS.get(device_type, DEFAULT_LIMITS["cpu"])
    return EngineConfig(
        max_running=config.max_running or max_running,
        max_waiting=config.max_waiting,
        max_step_tokens=config.max_step_tokens or max(max_step_tokens, config.max_running or 0),
        session_ttl_s=config.session_ttl_s,
        session_max_blocks=config.session_max_blocks,
        max_sessions=config.max_sessions,
        prefix_cache=config.prefix_cache,
        step_timeout_s=config.step_timeout_s,
        stream_interval=config.stream_interval,
        max_response_bytes=config.max_response_bytes,
        target_itl_ms=config.target_itl_ms,
        speculation=SpeculationConfig(
            method=_engine_method(config.speculative),
            max_drafts=config.speculative_tokens,
            max_batch=config.speculative_max_batch,
        ),
    )


def _engine_method(speculative: str) -> str:
    """The engine's speculation method for ``FURNACE_SPECULATIVE``: a draft model and the
    multi-token-prediction layer both fill placeholders on the model thread (``draft``)."""
    if draft_model_path(speculative) or speculative == "mtp":
        return "draft"
    return speculative


def build_engine(
    runner: StepRunner,
    tokenizer: Tokenizer,
    config: ServerConfig,
    device_type: str,
    model_thread: ModelThread,
) -> Engine:
    """The server's engine over a loaded model: its tokenizer's decode (and decode table,
    where it has one), EOS ids and token bytes, :func:`engine_config`'s settings, every
    step on ``model_thread``. The benchmarks build theirs here too, so that they measure
    the engine the server runs."""
    return Engine(
        runner,
        decode=tokenizer.decode,
        eos_token_ids=tokenizer.eos_token_ids,
        token_bytes=tokenizer.token_to_bytes,
        decode_table=tokenizer.decode_table(),
        config=engine_config(config, device_type),
        model_thread=model_thread,
    )


def runner_config(config: ServerConfig, device: str, device_type: str) -> RunnerConfig:
    """The runner's settings from the server's, for a resolved ``device``."""
    from furnace_trio.runtime.runner import RunnerConfig

    return RunnerConfig(
        device=device,
        dtype=config.dtype,
        kv_cache_bytes=_kv_cache_bytes(config, device_type),
        kv_dtype=config.kv_cache_dtype,
        max_context=config.max_context,
        quantization=config.quantization,
        cuda_graphs=None if config.cuda_graphs else False,
        native=config.native,
        native_build=config.native_build,
        mtp=config.speculative == "mtp",
    )


def load_draft(
    runner: ModelRunner, served: LoadedModel, path: str, settings: RunnerConfig
) -> DraftModel:
    """The draft model at ``path`` for ``runner``, which serves ``served``: its vocabulary
    checked against the served model's (:class:`UnsupportedModelError` naming both), run
    with ``settings`` (as the served model is) and a KV cache of as many blocks as the
    runner's, at most its context. Call it on the model thread."""
    from furnace_trio.loading.loader import load_model
    from furnace_trio.runtime.draft import DraftModel, check_vocabulary
    from furnace_trio.runtime.kv_cache import KVCache
    from furnace_trio.runtime.runner import ModelRunner

    try:
        draft = load_model(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"FURNACE_SPECULATIVE's draft model: {exc}") from None
    check_vocabulary(served, draft)
    per_block = KVCache.bytes_per_block(draft.config, runner.block_size, runner.kv_dtype)
    draft_settings = dataclasses.replace(
        settings,
        kv_cache_bytes=runner.num_blocks * per_block,
        max_context=runner.max_context,
        cuda_graphs=False,  # the draft runs with logits(), never from a graph
    )
    draft_runner = ModelRunner.from_loaded(draft, draft_settings)
    warm_up(draft_runner, 1)
    logger.info("speculative decoding: drafts from %s (%s)", draft.name, draft.source)
    return DraftModel(draft_runner, served.config.vocab_size)


def load_backend(config: ServerConfig) -> Backend:
    """Load the configured model (default: the embedded SmolLM2) and build its engine."""
    from furnace_trio.loading.loader import load_model
    from furnace_trio.runtime.runner import ModelRunner, resolve_device

    started = time.monotonic()
    device = resolve_device(config.device)
    settings = runner_config(config, str(device), device.type)

    def build() -> tuple[LoadedModel, ModelRunner]:
        loaded = load_model(config.model)
        if settings.mtp and not loaded.config.mtp_layers:
            raise UnsupportedModelError(
                f"FURNACE_SPECULATIVE=mtp: {loaded.name} ({loaded.source}) has no "
                "multi-token-prediction layers (MiMo checkpoints do); use ngram or "
                "draft:<path> instead"
            )
        runner = ModelRunner.from_loaded(loaded, settings)
        warm_up(runner, engine_config(config, device.type).max_running)
        draft_path = draft_model_path(config.speculative)
        if draft_path is not None:
            runner.drafter = load_draft(runner, loaded, draft_path, settings)
        if settings.mtp:
            from furnace_trio.runtime.mtp_draft import MTPDrafter

            runner.drafter = MTPDrafter(runner)
            logger.info("speculative decoding: drafts from %s's MTP layer", loaded.name)
        return loaded, runner

    # Loading, warm-up and every step on one thread: see model_thread.py.
    thread = ModelThread()
    try:
        loaded, runner = thread.call(build)
    except BaseException:
        thread.close()
        raise
    tokenizer = loaded.tokenizer
    engine = build_engine(runner, tokenizer, config, device.type, thread)
    grammar = GrammarCompiler(tokenizer)
    grammar.warm()
    logger.info(
        "loaded %s in %.1f s; sampling defaults %s (%s); max output tokens %s",
        loaded.name,
        time.monotonic() - started,
        loaded.generation.as_dict() or "OpenAI's",
        loaded.generation.source or "the model ships none",
        config.max_output_tokens or "the rest of the context (FURNACE_MAX_OUTPUT_TOKENS unset)",
    )
    return Backend(
        engine=engine,
        tokenizer=tokenizer,
        model_name=config.model_name or loaded.name,
        max_context=runner.max_context,
        generation=loaded.generation,
        max_output_tokens=config.max_output_tokens,
        grammar=grammar,
        device_type=device.type,
    )
