"""`export-hf` of a TorchTitan run: TorchTitan's own state-dict adapter (`ModelSpec.state_dict_adapter`, its
`to_hf`) as the name map, and, for our ``tiny`` flavours, the transformers config of the same model.

Per family (titan_integration/families.py), the transformers model type of its counterpart and what the export does:

* ``qwen3`` -> ``qwen3_moe``: exported; the adapter's names are the Hub checkpoints' (one tensor per expert),
  which ``from_pretrained`` converts to its grouped experts.
* ``deepseek_v3`` -> ``deepseek_v3``: exported (the router's ``expert_bias`` becomes ``e_score_correction_bias``).
  Our tiny flavour routes with softmax scores (TorchTitan's debug flavours do); transformers' DeepSeek-V3 always
  scores with a sigmoid, so its logits are not TorchTitan's: see docs/torchtitan.md "Export to Hugging Face".
* ``gpt_oss`` -> ``gpt_oss``: refused in one line: TorchTitan 0.3.0's adapter maps no expert tensor
  (``mlp1_weight_EGD`` ... are dropped by its ``to_hf``: the bug of TorchTitan PR #4475).
* ``kimi_k2_7`` -> ``kimi_k25`` and ``qwen3_5`` -> ``qwen3_5_moe``: refused in one line: their adapters' ``to_hf``
  fuse several tensors into one (the vision tower's q/k/v; Qwen3.5's in_proj q/k/v and the experts' w1/w3), which a
  per-tensor name map cannot call.
"""

from __future__ import annotations

from typing import Any

from titan_integration import families
from titan_integration.assets import TOKENIZER_VOCAB_SIZE

__all__ = ["HF_MODEL_TYPE", "titan_adapter", "titan_name_map_for", "tiny_hf_config"]

HF_MODEL_TYPE = {
    "qwen3": "qwen3_moe",
    "deepseek_v3": "deepseek_v3",
    "gpt_oss": "gpt_oss",
    "kimi_k2_7": "kimi_k25",
    "qwen3_5": "qwen3_5_moe",
}


def titan_adapter(family: str, flavor: str = "tiny") -> Any:
    """TorchTitan's state-dict adapter of ``family``/``flavor`` (its ModelSpec's ``state_dict_adapter``), built
    from the flavour's model config; no HF assets (the offline conversion path). On a machine without CUDA,
    TorchTitan is imported in CPU mode (titan_integration/cpu_mode.py: it cannot be imported there otherwise)."""
    if families._runs_on_cpu():
        from titan_integration.cpu_mode import enable_cpu_mode

        enable_cpu_mode()
    spec = families.model_spec(family, flavor, cpu=True)
    if spec.state_dict_adapter is None:
        from titan_integration.sparse_config import JobConfigError

        raise JobConfigError(f"TorchTitan's {family} has no state-dict adapter: it cannot be exported to HF names")
    return spec.state_dict_adapter(spec.model, None)


def titan_name_map_for(family: str, flavor: str = "tiny"):
    """`export.hf_names.titan_name_map` of the family's own adapter, after the model's own checkpoint layout.

    A window stores the training model's parameters by their names; TorchTitan's adapters take its ``state_dict()``
    names, which state-dict hooks may change: a fused ``FusedQKVLinear.wqkv`` (qwen3's and gpt-oss's tiny flavours,
    ``fuse_qkv=True``) saves as ``wq``/``wk``/``wv``. Each stored tensor first goes through the post hooks of the
    module that owns it (the module of a meta-device build of the flavour: TorchTitan's own code, no copy of it).
    """
    import torch

    from torchmoe_ckpt.export.hf_names import titan_name_map

    to_hf = titan_name_map(titan_adapter(family, flavor))
    with torch.device("meta"):
        meta = families.model_spec(family, flavor, cpu=True).model.build()
    hooked = {name: mod for name, mod in meta.named_modules() if name and mod._state_dict_hooks}

    def name_map(fqn: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        owner = fqn.rsplit(".", 1)[0]
        sd = {fqn: t}
        while owner:
            mod = hooked.get(owner)
            for hook in mod._state_dict_hooks.values() if mod is not None else ():
                hook(mod, sd, owner + ".", {})
            owner = owner.rsplit(".", 1)[0] if "." in owner else ""
        out: dict[str, torch.Tensor] = {}
        for k, v in sd.items():
            out.update(to_hf(k, v))
        return out

    name_map.checkpoint_names = True  # type: ignore[attr-defined]
    return name_map


def tiny_hf_config(family: str):
    """The transformers config of our ``tiny`` flavour of ``family`` (families.py's sizes, written out: TorchTitan
    0.3.0's adapters give no config). Only the families whose export runs, and gpt_oss (to show its refusal)."""
    from transformers import AutoConfig

    from titan_integration.families import DEEPSEEK_TINY as D
    from titan_integration.families import DIM, EXPERTS, HEAD_DIM, MOE_HIDDEN, N_HEADS, TOP_K

    vocab = TOKENIZER_VOCAB_SIZE
    common = dict(vocab_size=vocab, hidden_size=DIM, tie_word_embeddings=False, max_position_embeddings=4096)
    # qwen3's and gpt_oss's tiny flavours share their layers and attention (families.py)
    layers = dict(num_hidden_layers=2, num_attention_heads=N_HEADS, num_key_value_heads=2, head_dim=HEAD_DIM)
    if family == "qwen3":
        kw = dict(
            common,
            **layers,
            moe_intermediate_size=MOE_HIDDEN,
            intermediate_size=MOE_HIDDEN,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,  # TorchTitan's route_norm=True
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    elif family == "deepseek_v3":
        kw = dict(
            common,
            hidden_size=D["dim"],
            num_hidden_layers=D["n_layers"],
            first_k_dense_replace=D["n_dense_layers"],
            num_attention_heads=D["n_heads"],
            num_key_value_heads=D["n_heads"],
            q_lora_rank=None,
            kv_lora_rank=D["kv_lora_rank"],
            qk_nope_head_dim=D["qk_nope_head_dim"],
            qk_rope_head_dim=D["qk_rope_head_dim"],
            v_head_dim=D["v_head_dim"],
            head_dim=D["qk_rope_head_dim"],
            intermediate_size=D["dense_hidden_dim"],
            moe_intermediate_size=D["moe_hidden_dim"],
            n_routed_experts=D["num_experts"],
            n_shared_experts=D["num_shared_experts"],
            num_experts_per_tok=D["top_k"],
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,  # TorchTitan's route_norm=False, route_scale=1.0
            routed_scaling_factor=1.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096 * 40,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 4096,
                "mscale": 0.70,
                "mscale_all_dim": 0.70,
            },
        )
    elif family == "gpt_oss":
        kw = dict(
            common,
            **layers,
            intermediate_size=MOE_HIDDEN,
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        )
    else:
        from titan_integration.sparse_config import JobConfigError

        raise JobConfigError(
            f"no transformers config of {family}'s tiny flavour: its export is refused (titan_integration/hf_export.py)"
        )
    return AutoConfig.for_model(HF_MODEL_TYPE[family], **kw)
