"""Drafting with a multi-token-prediction layer (``FURNACE_SPECULATIVE=mtp``): its bounds.

No trained MTP checkpoint can be fetched here, so this measures what the mechanism costs
and what it can give, on MiMo-shaped checkpoints with random weights that the script writes
(a Qwen2 decoder of the shape asked for, SmolLM2's tokenizer, one MTP layer):

- **random**: random weights everywhere, so the layer's drafts (almost) never hold: the
  cost of running the layer on every token and of the drafts that fail (the worst case);
- **echo**: the decoder and the MTP block have zero output projections, so the model
  repeats its last token and the layer predicts just that: every draft holds (the best
  case, at the engine's adaptive draft length).

Each round runs the chat prompts (greedy, one stream) with speculation off and with
``mtp``, on engines of their own over runners of their own, interleaved in one process;
the texts of off and on must be identical. Weights are quantized at load as
``--quant`` says (the server's ``FURNACE_QUANT``).

    python benchmarks/bench_mtp.py [--shape small|1b] [--rounds 3] [--quant q4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from _common import machine
from _model_shapes import MODELS, SHAPES, hf_config, random_weights, write_shards, write_tokenizer
from bench_speculative import Run, chat_messages, run_rounds, run_workload

from furnace_trio.engine import Engine
from furnace_trio.engine.model_thread import ModelThread
from furnace_trio.loading.loader import LoadedModel, load_model
from furnace_trio.loading.model_config import MTP_PREFIX
from furnace_trio.runtime.mtp_draft import MTPDrafter
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig
from furnace_trio.server.backend import build_engine
from furnace_trio.server.config import ServerConfig

#: SmolLM2-135M's shape, beside _model_shapes.py's real sizes.
SMALL = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
}
MTP = f"{MTP_PREFIX}0."


def mimo_directory(shape: str, kind: str) -> Path:
    """A MiMo checkpoint of ``shape`` (``small`` or a _model_shapes.py shape), ``kind``
    ``random`` or ``echo`` (see the module docstring), written once under build/models."""
    out = MODELS / f"mimo-{shape}-{kind}"
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    dims = SMALL if shape == "small" else SHAPES[shape]
    config = hf_config(dims, "MiMoForCausalLM", "mimo", write_tokenizer(out))
    config |= {"rms_norm_eps": 1e-6, "rope_theta": 640000.0, "num_nextn_predict_layers": 1}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    parts = _mimo_weights(config, echo=kind == "echo")
    write_shards(out, parts, 2 + int(config["num_hidden_layers"]))
    return out


def _mimo_weights(config: dict, *, echo: bool) -> Iterator[dict[str, torch.Tensor]]:
    """_model_shapes.py's random Llama weights with Qwen2's q/k/v biases, then the MTP
    layer (a copy of the last layer's shapes), made to echo with ``echo``."""
    hidden = config["hidden_size"]
    last: dict[str, torch.Tensor] = {}
    for part in random_weights(config):
        for name in [
            n for n in part if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))
        ]:
            part[name.replace("weight", "bias")] = torch.zeros(part[name].shape[0])
        if echo:
            for name in [n for n in part if n.endswith(("o_proj.weight", "down_proj.weight"))]:
                part[name] = torch.zeros_like(part[name])
        if any(".layers." in n for n in part):
            last = part
        yield {n: t.to(torch.bfloat16).contiguous() for n, t in part.items()}
    mtp = {MTP + n.split(".", 3)[3]: t.clone() for n, t in last.items()}
    ones = torch.ones(hidden)
    mtp |= {MTP + f"{n}.weight": ones for n in ("token_layernorm", "hidden_layernorm")}
    mtp[MTP + "final_layernorm.weight"] = ones
    generator = torch.Generator().manual_seed(1)
    mtp[MTP + "input_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.02
    if echo:  # pass the token's embedding through (the head is the tied embedding)
        eye = torch.cat((torch.zeros(hidden, hidden), torch.eye(hidden)), dim=1)
        mtp[MTP + "input_proj.weight"] = eye
    yield {n: t.to(torch.bfloat16).contiguous() for n, t in mtp.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="small", help="small (135M) or 1b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quant", default="q4", help="FURNACE_QUANT for the weights")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    if args.shape != "small" and not SHAPES[args.shape]["tie_word_embeddings"]:
        parser.error("the echo model needs a shape with tied embeddings")
    settings = RunnerConfig(device="cpu", quantization=args.quant, kv_cache_bytes=256 << 20)
    engines: dict[tuple[str, str], Engine] = {}
    prompts: dict[str, list[tuple[int, ...]]] = {}
    for kind in ("random", "echo"):
        loaded: LoadedModel = load_model(str(mimo_directory(args.shape, kind)))
        tok = loaded.tokenizer
        prompts[kind] = [
            tuple(tok.encode(tok.apply_chat_template(m), add_special_tokens=False))
            for m in chat_messages()[: args.prompts]
        ]
        for method in ("off", "mtp"):
            thread = ModelThread()
            runner_settings = dataclasses.replace(settings, mtp=method == "mtp")
            runner = thread.call(ModelRunner.from_loaded, loaded, runner_settings)
            if method == "mtp":
                runner.drafter = MTPDrafter(runner)
            config = ServerConfig(speculative=method)
            engines[(kind, method)] = build_engine(runner, tok, config, "cpu", thread)
        del loaded
    totals: dict[tuple[str, str], list[Run]] = defaultdict(list)

    async def measure(r: int) -> None:
        for (kind, method), engine in engines.items():
            run = await run_workload(engine, prompts[kind], 1, args.max_tokens)
            totals[(kind, method)].append(run)
            print(
                f"round {r + 1} {kind} {method}: {run.tokens / run.seconds:.1f} tok/s, "
                f"{run.steps} steps, {run.accepted}/{run.drafted} drafts held",
                flush=True,
            )

    run_rounds(list(engines.values()), args.rounds, measure)
    print(f"\n{machine()}, MiMo-shaped {args.shape} ({args.quant}), {args.rounds} round(s)\n")
    print("| model | off tok/s | mtp tok/s | ratio per round | tokens/step on | held | same text |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind in ("random", "echo"):
        off, on = totals[(kind, "off")], totals[(kind, "mtp")]
        rate = [sum(r.tokens for r in runs) / sum(r.seconds for r in runs) for runs in (off, on)]
        ratios = ", ".join(
            f"{(b.tokens / b.seconds) / (a.tokens / a.seconds):.2f}x"
            for a, b in zip(off, on, strict=True)
        )
        per_step = sum(r.tokens for r in on) / max(1, sum(r.steps for r in on))
        held = f"{sum(r.accepted for r in on)}/{sum(r.drafted for r in on)}"
        same = all(a.texts == b.texts for a, b in zip(off, on, strict=True))
        print(
            f"| {kind} | {rate[0]:.1f} | {rate[1]:.1f} | {ratios} | {per_step:.2f} | {held} "
            f"| {'yes' if same else 'NO'} |"
        )


if __name__ == "__main__":
    main()
