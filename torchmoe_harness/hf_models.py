"""Tiny Hugging Face `transformers` MoE models of ANY model type, built from code (no hub access).

Not a table of per-family configs: `tiny_config` takes the model type's default config and shrinks every
size-like field by a rule on its name (hidden sizes, intermediate sizes, heads, head dims, LoRA ranks,
expert counts, top-k, expert groups, positions, vocabulary, per-layer lists, dense-layer prefixes), then
lets the config class recompute what it derives (`__post_init__`). A family whose config needs more
than these rules fails in `from_config` with the library's own message; nothing here names a family.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# Fields that hold the number of routed experts / experts per token, as spelled across families.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "top_k_experts",
    "moe_topk",
    "moe_top_k",
    "moe_k",
    "top_k",
)
_MOE_WORDS = re.compile(r"moe|expert|sparse", re.I)


@dataclass(frozen=True)
class TinySizes:
    layers: int = 2
    hidden: int = 32
    experts: int = 4
    top_k: int = 2
    vocab: int = 128
    heads: int = 2
    positions: int = 128

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _heads(v: int, cfg: dict, s: TinySizes) -> int:
    return s.heads


def _kv_heads(v: int, cfg: dict, s: TinySizes) -> int:
    # Keep grouped-query attention grouped (1 kv head) only where the full-size config groups.
    heads = cfg.get("num_attention_heads") or cfg.get("n_heads") or v
    return 1 if isinstance(heads, int) and v < heads else s.heads


def _ssm_head_dim(v: int, cfg: dict, s: TinySizes) -> int:
    # State-space heads tile the expanded inner width: heads * head_dim == expand * hidden.
    expand = next((cfg[k] for k in cfg if re.search(r"(mamba|ssm)?_?expand$", k) and isinstance(cfg[k], int)), 2)
    return expand * s.hidden // s.heads


# (field-name pattern, new value from (old value, whole config dict, sizes)); first match wins.
# Ints only (lists of ints element-wise); None and bool fields are left alone except where noted.
_RULES: list[tuple[re.Pattern, Callable[[int, dict, TinySizes], int]]] = [
    (re.compile(p), f)
    for p, f in [
        (r"^(num_hidden_layers|n_layers?|num_layers|num_decoder_layers)$", lambda v, c, s: s.layers),
        (rf"^({'|'.join(EXPERT_COUNT_KEYS)})$", lambda v, c, s: s.experts),
        (rf"^({'|'.join(TOP_K_KEYS)})$", lambda v, c, s: min(s.top_k, s.experts)),
        (r"shared_experts?$", lambda v, c, s: min(v, 1)),  # shared-expert counts: keep 0 or 1
        (r"(zero|null|identity)_experts?_num|num_(zero|null|identity)_experts", lambda v, c, s: 0),
        (r"^(n_group|topk_group|num_expert_group|n_groups|num_expert_groups|num_limited_groups)$", lambda v, c, s: 1),
        (
            r"(first_k_dense|dense_replace|dense_layers|moe_layer_start_index|layer_offset)",
            lambda v, c, s: min(v, 1, s.layers - 1),
        ),  # one dense layer at most
        (r"moe_layer_end_index", lambda v, c, s: s.layers - 1),
        (
            r"(sparse_step|moe_layer_interval|layer_period|moe_layer_step|moe_layer_freq)",
            lambda v, c, s: min(v, s.layers),
        ),
        (r"lora_rank$", lambda v, c, s: s.head_dim),
        (r"(mamba|ssm)_(d_head|head_dim)$", _ssm_head_dim),
        (r"head_dim$", lambda v, c, s: s.head_dim),
        (r"(num_)?(key_value|kv)_heads$|^kv_n_heads$|^num_kv_heads$|^multi_query_group_num$", _kv_heads),
        (r"heads?$|^n_head$|_heads_", _heads),
        (
            r"(intermediate_size|ffn_hidden_size|ffn_dim|expert_dim|hidden_size_mlp|moe_hidden_size|"
            r"intermediate_size_mlp|^ffn_size$)",
            lambda v, c, s: 2 * s.hidden,
        ),
        (r"^(hidden_size|d_model|n_embd|dim|hidden_dim|model_dim|embed_dim)$", lambda v, c, s: s.hidden),
        (r"^vocab_size$", lambda v, c, s: s.vocab),
        (r"_token_ids?$|_token_index$", lambda v, c, s: min(v, s.vocab - 1)),
        (r"^(max_position_embeddings|max_seq_len|n_positions|n_ctx|seq_length)$", lambda v, c, s: min(v, s.positions)),
        (
            r"(dt_rank|time_step_rank|ssm_state_size|d_state|state_size|kv_latent_dim|_latent_size)$",
            lambda v, c, s: min(v, s.head_dim),
        ),
    ]
]
_ENABLE_MOE = re.compile(r"^(is_moe|use_moe|enable_moe\w*)$")


def _shrink_value(key: str, value: Any, cfg: dict, s: TinySizes, n_layers: int | None) -> Any:
    if isinstance(value, bool):
        return True if _ENABLE_MOE.match(key) else value
    if value is None:
        # Expert fields left at None (the family's default is dense) get experts anyway; a head dim left
        # at None is the one the model would derive.
        if key in EXPERT_COUNT_KEYS:
            return s.experts
        if key in TOP_K_KEYS:
            return min(s.top_k, s.experts)
        if key.endswith(("shared_experts", "shared_expert")):
            return 1
        return s.head_dim if key == "head_dim" else None
    if isinstance(value, list) and n_layers and len(value) == n_layers and n_layers != s.layers:
        return _resize_layer_list(value, s.layers)
    if isinstance(value, list) and value and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        if key.endswith("layers") and n_layers and all(0 <= x < n_layers for x in value):
            # A list of layer indices: dense-only lists leave the last layer MoE, MoE lists keep one layer.
            if re.search(r"dense|mlp_only|only", key):
                return [x for x in value if x < s.layers - 1]
            return [x for x in value if x < s.layers] or [s.layers - 1]
        return [_shrink_value(key, x, cfg, s, n_layers) for x in value]
    if isinstance(value, int):
        for pattern, rule in _RULES:
            if pattern.search(key):
                return rule(value, cfg, s) if value > 0 else value
    return value


def _resize_layer_list(value: list, layers: int) -> list:
    """A per-layer list cut to `layers` that keeps every kind of layer it can (MoE kinds first, then full
    attention): a hybrid cut to its first layers would otherwise lose its MoE or its only attention layer."""

    def rank(x) -> int:
        text = str(x)
        return 0 if _MOE_WORDS.search(text) else 1 if "full" in text or text == "attention" else 2

    try:
        kinds = list(dict.fromkeys(value))
    except TypeError:  # per-layer entries that are lists themselves: a plain cut
        return list(value[:layers])
    keep = sorted(sorted(kinds, key=rank)[:layers], key=kinds.index)
    out = list(value[:layers])
    for kind in keep:
        if kind not in out:
            # Overwrite the last entry whose kind is repeated or not kept.
            i = max(i for i, x in enumerate(out) if out.count(x) > 1 or x not in keep)
            out[i] = kind
    return out


def _n_layers(cfg: dict) -> int | None:
    for key in ("num_hidden_layers", "n_layers", "num_layers", "n_layer", "num_decoder_layers"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None


def _shrunk_fields(config: PreTrainedConfig, s: TinySizes) -> dict[str, Any]:
    """The dataclass fields of `config` that the rules change (sub-configs shrunk recursively)."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    values = {name: getattr(config, name, None) for name in fields}
    n_layers = _n_layers(values)
    out: dict[str, Any] = {}
    for key, value in values.items():
        if fields[key].default is None and value is not None and not isinstance(value, (list, PreTrainedConfig)):
            continue  # derived in __post_init__ (qk_head_dim, ...): derived again from the new sizes
        if isinstance(value, PreTrainedConfig):
            out[key] = type(value)(**_shrunk_fields(value, s))
        elif key not in ("id2label", "label2id", "transformers_version", "architectures"):
            new = _shrink_value(key, value, values, s, n_layers)
            if new is not value and new != value:
                out[key] = new
    return out


def _expert_fields(config: PreTrainedConfig) -> list[str]:
    found = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name, None)
        if isinstance(value, PreTrainedConfig):
            found += [f"{f.name}.{k}" for k in _expert_fields(value)]
        elif f.name in EXPERT_COUNT_KEYS:
            found.append(f.name)
    return found


def is_moe_model_type(model_type: str) -> bool:
    """True when `model_type` is known to transformers, has a causal-LM class, and its config has an
    expert-count field (on itself or a sub-config)."""
    if model_type not in CONFIG_MAPPING_NAMES or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return False
    try:
        return bool(_expert_fields(AutoConfig.for_model(model_type)))
    except Exception:  # a config that cannot even be built with its defaults is not usable here
        return False


def moe_model_types() -> list[str]:
    """Every MoE model type this transformers version can build as a causal LM."""
    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if is_moe_model_type(t))


def tiny_config(
    model_type: str, *, layers: int = 2, hidden: int = 32, experts: int = 4, top_k: int = 2, vocab: int = 128
) -> PreTrainedConfig:
    """`model_type`'s default config with every size-like field shrunk by rule; ValueError (one line) for a
    type transformers does not know or one without experts."""
    if model_type not in CONFIG_MAPPING_NAMES:
        raise ValueError(f"unknown transformers model type {model_type!r} (transformers {transformers.__version__})")
    if not is_moe_model_type(model_type):
        raise ValueError(
            f"transformers model type {model_type!r} is not a Mixture-of-Experts causal LM "
            f"(no expert-count field such as {'/'.join(EXPERT_COUNT_KEYS)} in its config); "
            f"pick an MoE type, e.g. mixtral or deepseek_v3"
        )
    s = TinySizes(layers=layers, hidden=hidden, experts=experts, top_k=top_k, vocab=vocab)
    base = AutoConfig.for_model(model_type)
    try:
        cfg = AutoConfig.for_model(model_type, **_shrunk_fields(base, s))
    except Exception:
        if top_k == 1:
            raise
        # Some families route to exactly one expert (their config validation says so): retry with k = 1.
        cfg = AutoConfig.for_model(model_type, **_shrunk_fields(base, dataclasses.replace(s, top_k=1)))
    cfg._attn_implementation = "eager"  # deterministic on CPU, no SDPA/flash kernel choice
    cfg.use_cache = False  # training: no KV/state cache (all-linear-attention hybrids need none)
    return cfg


def build_hf_model(
    model_type: str,
    *,
    layers: int = 2,
    hidden: int = 32,
    experts: int = 4,
    top_k: int = 2,
    vocab: int = 128,
    seed: int = 0,
) -> torch.nn.Module:
    """A tiny fp32 `AutoModelForCausalLM` of `model_type`, initialised deterministically from `seed`."""
    cfg = tiny_config(model_type, layers=layers, hidden=hidden, experts=experts, top_k=top_k, vocab=vocab)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    return model
