"""A tiny MiMo checkpoint (Qwen2 with a multi-token-prediction layer) and its references.

transformers has no MiMo class (the checkpoints carry their own modeling code), so the
references are built from transformers' Qwen2 modules: the decoder is
``Qwen2ForCausalLM`` on the same weights, and the MTP layer is
:func:`reference_mtp_logits`, written from the checkpoint's modeling code
(``MiMoMTPLayers``: ``input_proj(cat(hidden_layernorm(h), token_layernorm(embed(next))))``,
a Qwen2 decoder layer, ``final_layernorm``, the LM head), over a whole sequence at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from furnace_trio.loading.model_config import MTP_PREFIX

from ._model_fixtures import write_tiny_model

MTP = f"{MTP_PREFIX}0"


def write_tiny_mimo(tmp_path: Path, *, echo: bool = False) -> Path:
    """A tiny random MiMo directory: the tiny Qwen2's decoder and tokenizer (untied) plus
    one MTP layer of random weights.

    ``echo``: a model whose greedy output repeats its last token, and an MTP layer that
    predicts the same (the decoder's and the MTP block's output projections are zero, so
    each passes the token's embedding through, and the LM head is the embedding), so that
    every draft holds."""
    directory = write_tiny_model(tmp_path, "qwen2", tied=False)
    mimo = tmp_path / ("tiny-mimo-echo" if echo else "tiny-mimo")
    directory.rename(mimo)
    weights = load_file(mimo / "model.safetensors")
    hidden = weights["model.norm.weight"].shape[0]
    generator = torch.Generator().manual_seed(7)
    layer = {
        name.removeprefix("model.layers.0."): tensor
        for name, tensor in weights.items()
        if name.startswith("model.layers.0.")
    }
    for name, tensor in layer.items():
        noise = torch.randn(tensor.shape, generator=generator)
        weights[f"{MTP}.{name}"] = tensor + 0.1 * noise
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        weights[f"{MTP}.{norm}.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=generator)
    weights[f"{MTP}.input_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=generator)
    if echo:
        for name in list(weights):
            if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                weights[name] = torch.zeros_like(weights[name])
        weights[f"{MTP}.input_proj.weight"] = torch.cat(
            (torch.zeros(hidden, hidden), torch.eye(hidden)), dim=1
        )
        for norm in ("token_layernorm", "final_layernorm"):
            weights[f"{MTP}.{norm}.weight"] = torch.ones(hidden)
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file({k: v.contiguous() for k, v in weights.items()}, mimo / "model.safetensors")
    config = json.loads((mimo / "config.json").read_text())
    config.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (mimo / "config.json").write_text(json.dumps(config, indent=2))
    return mimo


def reference_model(directory: Path) -> Any:
    """transformers' ``Qwen2ForCausalLM`` on the directory's decoder weights (float32)."""
    import transformers

    raw = json.loads((directory / "config.json").read_text())
    for key in ("model_type", "architectures", "num_nextn_predict_layers"):
        raw.pop(key, None)
    config = transformers.Qwen2Config(**raw)
    model = transformers.Qwen2ForCausalLM(config).eval()
    state = {k: v for k, v in load_file(directory / "model.safetensors").items() if MTP not in k}
    model.load_state_dict(state, strict=True)
    return model


def reference_mtp_logits(directory: Path, model: Any, ids: list[int]) -> torch.Tensor:
    """The MTP layer's logits at positions ``0 .. len(ids) - 2`` of ``ids`` (row ``j``
    predicts ``ids[j + 2]``), computed over the whole sequence as the checkpoint's modeling
    code does: the decoder's normed hidden state at ``j`` with the token at ``j + 1``."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

    config = model.config
    weights = load_file(directory / "model.safetensors")
    eps = config.rms_norm_eps

    def norm(name: str) -> Any:
        module = Qwen2RMSNorm(config.hidden_size, eps=eps)
        module.weight.data.copy_(weights[f"{MTP}.{name}.weight"])
        return module

    block = Qwen2DecoderLayer(config, layer_idx=0).eval()
    parts = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")
    block.load_state_dict(
        {
            k.removeprefix(f"{MTP}."): v
            for k, v in weights.items()
            if k.removeprefix(f"{MTP}.").startswith(parts)
        }
    )
    proj = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    proj.weight.data.copy_(weights[f"{MTP}.input_proj.weight"])
    with torch.no_grad():
        tokens = torch.tensor([ids])
        hidden = model.model(tokens).last_hidden_state[:, :-1]
        embeds = model.model.embed_tokens(tokens[:, 1:])
        x = proj(torch.cat((norm("hidden_layernorm")(hidden), norm("token_layernorm")(embeds)), -1))
        positions = torch.arange(x.shape[1])[None, :]
        rotary = model.model.rotary_emb(x, positions)
        out = block(x, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        out = out[0] if isinstance(out, tuple) else out
        return model.lm_head(norm("final_layernorm")(out))[0].float()
