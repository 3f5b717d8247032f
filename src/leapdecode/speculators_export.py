"""`leapdecode export --format speculators`: an EAGLE head in the layout vLLM loads directly.

The "speculators" format (vllm-project/speculators, `Eagle3SpeculatorConfig`), which vLLM
recognises by the `speculators_config` key of config.json and runs as
`Eagle3LlamaForCausalLM` (docs/export.md gives the whole mapping):

    config.json
      speculators_model_type "eagle3", architectures ["Eagle3Speculator"],
      transformer_layer_config   the draft layer as a Llama config (vocab_size = the target's)
      draft_vocab_size, target_hidden_size, norm_before_residual (false),
      eagle_aux_hidden_state_layer_ids   the target layers whose input the head reads
      speculators_config  {algorithm "eagle3", proposal_methods [{proposal_type "greedy",
                           speculative_tokens, verifier_accept_k 1, accept_tolerance 0.0}],
                           default_proposal_method "greedy",
                           verifier {name_or_path, architectures}}
    model.safetensors
      fc.weight [H, 3 T]; layers.0.self_attn.{q,k,v}_proj.weight [heads x D, 2 H];
      layers.0.self_attn.o_proj.weight [H, heads x D]; layers.0.{input_layernorm,
      hidden_norm, post_attention_layernorm}.weight [H]; layers.0.mlp.{gate,up}_proj.weight
      [I, H]; layers.0.mlp.down_proj.weight [H, I]; norm.weight [H]; lm_head.weight [Vd, H];
      d2t [Vd] int64 (target id = draft id + d2t[draft id]); t2d [V] bool;
      embed_tokens.weight [V, H] (the target's own: vLLM shares it when identical)

A parallel head (`leapdecode train peagle`) exports as speculators' "peagle" type (vLLM
runs it as eagle3 with parallel_drafting): `mask_token_id` in config.json and its
`mask_hidden` [3 T] (a mask slot's aux hidden states) in the weights.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .errors import LeapDecodeError
from .models.eagle import Eagle3Head

SPECULATORS_VERSION = "0.3.0"  # the speculators release whose layout this writes

# our parameter name -> speculators / vLLM name
NAMES = {
    "fc.weight": "fc.weight",
    "input_layernorm.weight": "layers.0.input_layernorm.weight",
    "hidden_norm.weight": "layers.0.hidden_norm.weight",
    "q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "post_attention_layernorm.weight": "layers.0.post_attention_layernorm.weight",
    "gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "up_proj.weight": "layers.0.mlp.up_proj.weight",
    "down_proj.weight": "layers.0.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "mask_hidden": "mask_hidden",  # a parallel head's (P-EAGLE)
}


def export_speculators(
    head_dir: str,
    target_dir: str,
    out: str,
    verifier: str | None = None,
    speculative_tokens: int = 3,
    dtype: str = "bfloat16",
) -> dict:
    """Write `out` (config.json + model.safetensors); returns the config."""
    head = Eagle3Head.load(head_dir)
    cfg_path = os.path.join(target_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise LeapDecodeError(f"--target {target_dir!r} has no config.json: pass the target folder")
    with open(cfg_path) as f:
        target_cfg = json.load(f)
    if target_cfg.get("hidden_size") != head.target_hidden:
        raise LeapDecodeError(
            f"the head was trained on a target of hidden size {head.target_hidden}, "
            f"{target_dir!r} has {target_cfg.get('hidden_size')}: pass the head's own target"
        )
    aux = list(head.aux_layers)
    if len(aux) != 3 or not 1 <= aux[0] < aux[1] < aux[2]:
        raise LeapDecodeError(
            f"vLLM's EAGLE-3 reads three distinct target layers in ascending order; this head "
            f"reads {aux}: train it on a target of 4 or more layers (`leapdecode train eagle`)"
        )
    if dtype not in ("bfloat16", "float16", "float32"):
        raise LeapDecodeError("--dtype must be bfloat16, float16 or float32")
    if not 1 <= speculative_tokens <= 16:
        raise LeapDecodeError("--speculative-tokens must be in 1..16")
    torch_dtype = getattr(torch, dtype)
    state = head.state_dict()
    tensors = {NAMES[k]: v.detach().to(torch_dtype).contiguous() for k, v in state.items()}
    tensors["d2t"] = head.d2t().long()
    t2d = torch.zeros(head.vocab_size, dtype=torch.bool)
    t2d[head.draft_ids] = True
    tensors["t2d"] = t2d
    embed = _target_embeddings(target_dir)
    tensors["embed_tokens.weight"] = embed.to(torch_dtype).contiguous()
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": head.hidden,
        "num_attention_heads": head.heads,
        "num_key_value_heads": head.kv_heads,
        "head_dim": head.head_dim,
        "intermediate_size": head.intermediate,
        "hidden_act": "silu",
        "rms_norm_eps": head.eps,
        "rope_theta": head.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": int(target_cfg.get("max_position_embeddings", 4096)),
        "num_hidden_layers": 1,
        "vocab_size": head.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    kind = "peagle" if head.parallel else "eagle3"
    config = {
        "architectures": ["PeagleSpeculator" if head.parallel else "Eagle3Speculator"],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": head.draft_vocab_size,
        "target_hidden_size": head.target_hidden,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(head.aux_layers),
        **({"mask_token_id": head.pard_token} if head.parallel else {}),
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": verifier or os.path.abspath(target_dir),
                "architectures": target_cfg.get("architectures", ["LlamaForCausalLM"]),
            },
        },
        "torch_dtype": dtype,
        "tie_word_embeddings": False,
    }
    try:
        os.makedirs(out, exist_ok=True)
        cfg_path = os.path.join(out, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(config, f, indent=1)
        weights = os.path.join(out, "model.safetensors")
        save_file(tensors, weights, metadata={"format": "pt"})
        shutil.copymode(cfg_path, weights)  # safetensors writes 0600: as readable as the config
    except (OSError, SafetensorError) as e:
        raise LeapDecodeError(
            f"cannot write the export to {out!r}: "
            f"{getattr(e, 'strerror', None) or e}: choose a writable --out "
            "folder"
        ) from None
    return config


def _target_embeddings(target_dir: str) -> torch.Tensor:
    from .models.llama import read_safetensors

    state = read_safetensors(target_dir)
    for name in ("model.embed_tokens.weight", "embed_tokens.weight"):
        if name in state:
            return state[name]
    raise LeapDecodeError(f"{target_dir!r} has no model.embed_tokens.weight")
