"""TorchTitan 0.3.0's MoE families, as the job file and the config registry name them.

One :class:`Family` per model package of ``torchtitan.models`` that trains an MoE: its flavour table (what
``[model] flavor`` is checked against), the flavour our CPU tests and demo run, and the keyword arguments its
``model_registry`` needs on a CPU. Each family gets a ``tiny`` flavour registered in TorchTitan's own
table: the family's real model code (its attention, router, shared experts, biases, sinks, vision tower) with
every size shrunk, so that a training step on 2 CPU ranks takes a fraction of a second. Sizes follow each
family's ``_debugmodel``; only widths, depths and vocabulary shrink (the vocabulary to our offline tokenizer's,
:data:`titan_integration.assets.TOKENIZER_VOCAB_SIZE`). The gpt-oss tiny has 4 heads of 16 and a sliding window of
16 tokens on its even layers (TorchTitan's builder fixes 64 heads of 64 and a window of 128, longer than our
64-token sequences), the Kimi tiny a one-layer MoonViT, the Qwen3.5 tiny one Gated DeltaNet layer then one gated
attention layer (TorchTitan's pattern with a full-attention interval of 2 instead of 4) and a one-layer vision tower.

Qwen3.5's Gated DeltaNet layers import ``fla`` (flash-linear-attention), whose kernels are triton GPU kernels. CPU
mode puts plain-torch reference implementations under fla's names (:mod:`titan_integration.fla_cpu`); only a
machine that has CUDA but no ``fla`` refuses the family, in one line (:func:`missing`, :func:`family_module`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from titan_integration.assets import TOKENIZER_VOCAB_SIZE
from titan_integration.sparse_config import JobConfigError

__all__ = [
    "DEEPSEEK_TINY",
    "Family",
    "FAMILIES",
    "family",
    "missing",
    "family_module",
    "flavors",
    "model_spec",
    "register_tiny_flavors",
]

TINY = "tiny"


@dataclass(frozen=True)
class Family:
    name: str  # the package under torchtitan.models, and the job file's [model] name
    table: str  # the flavour table's name in that package
    flavor: str  # what our job file, tests and demo run by default
    debug_flavor: str  # TorchTitan's own debug flavour of the MoE model
    cpu_kwargs: tuple[tuple[str, Any], ...] = ()  # model_registry keywords a CPU needs (an attention backend)
    needs: str = ""  # what the family needs that may be missing ("" = nothing beyond TorchTitan)
    needs_module: str = ""  # the module that stands for it (checked without importing TorchTitan)
    cpu_stand_in: bool = False  # CPU mode replaces ``needs_module`` (titan_integration.fla_cpu): no GPU, no need
    # FSDP's compute dtype on a CPU (CPU mode's float32 is 7x faster there than bf16); gpt-oss's experts cast to
    # bfloat16 for their grouped GEMMs whatever the input, and TorchTitan's combine then scatters bf16 rows into a
    # float32 output ("scatter(): Expected self.dtype to be equal to src.dtype"): it trains in bf16, as on a GPU.
    cpu_param_dtype: str = "float32"


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("deepseek_v3", "deepseekv3_configs", TINY, "debugmodel"),
        Family("qwen3", "qwen3_configs", TINY, "debugmodel_moe"),
        # gpt-oss defaults to the varlen (flash) backend, CUDA only; flex runs on CPU (with its sinks' LSE).
        Family(
            "gpt_oss",
            "gptoss_configs",
            TINY,
            "debugmodel",
            cpu_kwargs=(("attn_backend", "flex"),),
            cpu_param_dtype="bfloat16",
        ),
        Family("kimi_k2_7", "kimi_k2_5_configs", TINY, "debugmodel"),
        Family(
            "qwen3_5",
            "qwen3_5_configs",
            TINY,
            "debugmodel_moe",
            needs="flash-linear-attention (the triton GPU kernels of its Gated DeltaNet layers)",
            needs_module="fla",
            cpu_stand_in=True,
        ),
    )
}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise JobConfigError(
            f"[model] name = {name!r} is not a TorchTitan MoE family; fix: use one of {', '.join(FAMILIES)}"
        )
    return FAMILIES[name]


def _runs_on_cpu() -> bool:
    """Whether our launcher runs TorchTitan in CPU mode here (titan_integration.train.want_cpu_mode's rule)."""
    from titan_integration.cpu_mode import cpu_mode_enabled

    env = os.environ.get("TORCHMOE_TITAN_CPU")
    if env is not None:
        return env not in ("0", "false", "no", "")
    if cpu_mode_enabled():
        return True
    import torch

    return not torch.cuda.is_available()


def missing(name: str) -> str | None:
    """What ``name`` needs that is not installed, as one refusal line; None: it can run here (on a CPU, a family
    with a ``cpu_stand_in`` runs on it instead)."""
    fam = family(name)
    if not fam.needs_module or importlib.util.find_spec(fam.needs_module) is not None:
        return None
    if fam.cpu_stand_in and _runs_on_cpu():
        return None
    return (
        f"TorchTitan's {name} needs {fam.needs} (module {fam.needs_module!r} is not installed, and this machine "
        f"has CUDA, so CPU mode's reference implementation does not apply); fix: pip install "
        f"flash-linear-attention, or pick one of {', '.join(n for n, f in FAMILIES.items() if not f.needs)}"
    )


def family_module(name: str) -> ModuleType:
    """``torchtitan.models.<name>`` with our tiny flavours registered; a family that cannot load is one line."""
    fam = family(name)
    try:
        mod = importlib.import_module(f"torchtitan.models.{name}")
    except ImportError as exc:
        raise JobConfigError(
            f"[model] name = {name!r}: TorchTitan's {name} cannot be imported here ({exc}); "
            f"it needs {fam.needs or exc}; fix: install it on a GPU machine, or use one of "
            f"{', '.join(n for n, f in FAMILIES.items() if not f.needs)}"
        ) from None
    register_tiny_flavors(name, mod)
    return mod


def flavors(name: str) -> list[str]:
    fam = family(name)
    return sorted(getattr(family_module(name), fam.table))


def model_spec(name: str, flavor: str, *, cpu: bool):
    """TorchTitan's ModelSpec of ``name``/``flavor``; an unknown flavour is one line listing the valid ones."""
    fam = family(name)
    valid = flavors(name)
    if flavor not in valid:
        raise JobConfigError(f"[model] flavor = {flavor!r} is not a {name} flavour; fix: use one of {', '.join(valid)}")
    kwargs = dict(fam.cpu_kwargs) if cpu else {}
    return family_module(name).model_registry(flavor, **kwargs)


# ---- the tiny flavours -------------------------------------------------------------------------------------
DIM, N_HEADS, HEAD_DIM, MOE_HIDDEN, EXPERTS, TOP_K = 64, 4, 16, 32, 8, 2
VOCAB = TOKENIZER_VOCAB_SIZE


# DeepSeek-V3's tiny sizes (documented in docs/torchtitan-cpu-mode.md; config_registry.TINY).
DEEPSEEK_TINY = dict(
    dim=64,
    n_layers=3,  # layer 0 dense FFN (as in DeepSeek-V3), layers 1-2 MoE
    n_dense_layers=1,
    n_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    dense_hidden_dim=128,
    moe_hidden_dim=32,
    num_experts=8,
    num_shared_experts=1,
    top_k=2,
    vocab_size=TOKENIZER_VOCAB_SIZE,
    seq_len=64,
    local_batch_size=4,
)


def _yarn_rope(dim: int, max_seq_len: int):
    """The YaRN rotary embedding DeepSeek-V3 and Kimi K2.5 share in TorchTitan's flavours (4096 trained, 40x)."""
    from torchtitan.models.common import ComplexRoPE

    return ComplexRoPE.Config(
        dim=dim,
        max_seq_len=max_seq_len,
        theta=10000.0,
        scaling="yarn",
        rope_factor=40.0,
        beta_fast=32.0,
        beta_slow=1.0,
        original_seq_len=4096,
    )


def _deepseek_v3_tiny(
    attn_backend: str,
    moe_comm_backend: str,
    non_blocking_capacity_factor: float | None = None,
    num_mtp_layers: int = 0,
) -> Any:
    """DeepSeek-V3 ``tiny`` flavour: ``_debugmodel`` from TorchTitan with every size shrunk."""
    from torchtitan.models import deepseek_v3 as _dsv3
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    t = DEEPSEEK_TINY
    dim, vocab_size, rope_dim = t["dim"], t["vocab_size"], t["qk_rope_head_dim"]
    layers = _dsv3._build_dsv3_layers(
        n_layers=t["n_layers"],
        n_dense_layers=t["n_dense_layers"],
        dim=dim,
        n_heads=t["n_heads"],
        q_lora_rank=0,
        kv_lora_rank=t["kv_lora_rank"],
        qk_nope_head_dim=t["qk_nope_head_dim"],
        qk_rope_head_dim=rope_dim,
        v_head_dim=t["v_head_dim"],
        mscale=0.70,
        dense_hidden_dim=t["dense_hidden_dim"],
        moe_hidden_dim=t["moe_hidden_dim"],
        num_experts=t["num_experts"],
        num_shared_experts=t["num_shared_experts"],
        router_top_k=t["top_k"],
        router_score_func="softmax",
        attn_backend=attn_backend,
        moe_comm_backend=moe_comm_backend,
        non_blocking_capacity_factor=non_blocking_capacity_factor,
        rope=_yarn_rope(rope_dim, max_seq_len=4096),
    )
    return _dsv3.DeepSeekV3Model.Config(
        vocab_size=vocab_size,
        dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim, param_init=_dsv3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_dsv3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=_dsv3._output_linear_init(dim)),
        layers=layers,
        mtp_layers=_dsv3._build_mtp_layers(layers[-1], dim=dim, num_mtp_layers=num_mtp_layers),
    )


def _qwen3_tiny(attn_backend: str = "flex", moe_comm_backend: str = "standard"):
    from torchtitan.models import qwen3 as q
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    return q.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=q._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=q._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=q._LINEAR_INIT),
        layers=q._build_qwen3_moe_layers(
            fuse_qkv=True,
            n_layers=2,
            dim=DIM,
            n_heads=N_HEADS,
            n_kv_heads=2,
            head_dim=HEAD_DIM,
            moe_hidden_dim=MOE_HIDDEN,
            num_experts=EXPERTS,
            top_k=TOP_K,
            attn_backend=attn_backend,
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=4096, theta=1000000.0),
            moe_comm_backend=moe_comm_backend,
        ),
    )


def _gpt_oss_tiny(moe_comm_backend: str = "standard", attn_backend: str = "flex"):
    from torchtitan.models import gpt_oss as g
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm

    rope = CosSinRoPE.Config(
        dim=HEAD_DIM,
        max_seq_len=131072,
        theta=150000.0,
        scaling="yarn",
        rope_factor=32,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_seq_len=4096,
    )
    layers = g._build_gptoss_layers(
        fuse_qkv=True,
        dim=DIM,
        n_layers=2,
        hidden_dim=MOE_HIDDEN,
        num_experts=EXPERTS,
        top_k=TOP_K,
        load_balance_coeff=1e-3,
        attn_backend=attn_backend,
        moe_comm_backend=moe_comm_backend,
        rope=rope,
    )
    for i, layer in enumerate(layers):  # the builder fixes 64 heads of 64; the same attention, narrower
        layer.attention = g._make_gptoss_attn_config(
            dim=DIM,
            layer_id=i,
            attn_backend=attn_backend,
            n_heads=N_HEADS,
            n_kv_heads=2,
            head_dim=HEAD_DIM,
            sliding_window_size=16 if i % 2 == 0 else None,  # even layers slide (shorter than seq_len, so it shows)
            rope=rope,
        )
    return g.GptOssModel.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=g._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=g._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=g._output_linear_init(DIM)),
        layers=layers,
    )


def _kimi_tiny(attn_backend: str = "flex", moe_comm_backend: str = "standard", non_blocking_capacity_factor=None):
    """Kimi K2.5's MLA/MoE text tower (a dense first layer, 2 shared experts) and its MoonViT vision tower."""
    from torchtitan.models import kimi_k2_7 as k
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    layers = k._build_kimi_layers(
        n_layers=3,
        n_dense_layers=1,
        dim=DIM,
        n_heads=N_HEADS,
        q_lora_rank=0,
        kv_lora_rank=32,
        qk_nope_head_dim=HEAD_DIM,
        qk_rope_head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        mscale=0.70,
        dense_hidden_dim=128,
        moe_hidden_dim=MOE_HIDDEN,
        num_experts=EXPERTS,
        num_shared_experts=2,
        router_top_k=3,
        router_score_func="softmax",
        attn_backend=attn_backend,
        moe_comm_backend=moe_comm_backend,
        non_blocking_capacity_factor=non_blocking_capacity_factor,
        rope=_yarn_rope(HEAD_DIM, max_seq_len=4096 * 4),
    )
    return k.KimiK25Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=k._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=k._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=k._output_linear_init(DIM)),
        layers=layers,
        vision_encoder=k._vision_encoder_config(
            dim=32,
            ffn_dim=64,
            num_layers=1,
            num_heads=2,
            patch_size=14,
            init_pos_emb_height=4,
            init_pos_emb_width=4,
            text_hidden_size=DIM,
        ),
    )


def _qwen3_5_tiny(attn_backend: str = "flex", moe_comm_backend: str = "standard"):
    """Qwen3.5 MoE: a Gated DeltaNet layer (q/k/v convolutions, 2 key heads, 4 value heads), a gated attention
    layer (partial multimodal RoPE), 8 experts top-2 with a shared expert in both, a one-layer vision tower."""
    from torchtitan.models import qwen3_5 as q
    from torchtitan.models.common import Embedding, Linear

    return q.Qwen35Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=q._offset_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=q._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=q._output_linear_init(DIM)),
        layers=q._build_qwen35_moe_layers(
            # mrope_section sums to rotary_dim / 2, as in the debug flavours
            rope=q.MRoPE.Config(dim=16, max_seq_len=4096, theta=10_000_000.0, mrope_section=[3, 3, 2]),
            attn_backend=attn_backend,
            n_layers=2,
            full_attention_interval=2,
            dim=DIM,
            n_heads=N_HEADS,
            n_kv_heads=2,
            head_dim=32,
            rotary_dim=16,
            moe_hidden_dim=MOE_HIDDEN,
            num_experts=EXPERTS,
            top_k=TOP_K,
            shared_expert_hidden_dim=MOE_HIDDEN,
            n_key_heads=2,
            n_value_heads=4,
            key_head_dim=HEAD_DIM,
            value_head_dim=HEAD_DIM,
            moe_comm_backend=moe_comm_backend,
            fla_backend="fla_chunked",
        ),
        vision_encoder=q._qwen35_vision_encoder_config(
            dim=32,
            ffn_dim=64,
            num_layers=1,
            num_heads=2,
            patch_size=16,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=DIM,
            num_position_embeddings=64,
        ),
    )


_TINY_BUILDERS = {
    "deepseek_v3": _deepseek_v3_tiny,
    "qwen3": _qwen3_tiny,
    "gpt_oss": _gpt_oss_tiny,
    "kimi_k2_7": _kimi_tiny,
    "qwen3_5": _qwen3_5_tiny,
}


def _qwen3_5_text_batches(mod: ModuleType) -> None:
    """Let Qwen3.5 train on text batches. TorchTitan 0.3.0's ``Qwen35Model._prepare_multimodal_embeds`` reads
    ``special_tokens["image_id"]`` before it looks for pixels, and only its multimodal collator passes
    ``special_tokens``: a text data loader's batch fails with "'NoneType' object is not subscriptable". The ids
    are only used to place vision embeddings, so a batch without pixels gets ids that match no token (Kimi K2.5's
    model already takes ``special_tokens=None`` for text-only batches)."""
    cls = mod.Qwen35Model
    if getattr(cls, "_torchmoe_text_batches", False):
        return
    original = cls._prepare_multimodal_embeds

    def prepare(self, tokens, *, special_tokens=None, **kwargs):
        if special_tokens is None and kwargs.get("pixel_values") is None and kwargs.get("pixel_values_videos") is None:
            special_tokens = {"image_id": -1, "video_id": -1}  # no token id is negative: nothing to place
        return original(self, tokens, special_tokens=special_tokens, **kwargs)

    cls._prepare_multimodal_embeds = prepare
    cls._torchmoe_text_batches = True


def register_tiny_flavors(name: str, mod: ModuleType) -> None:
    """Our ``tiny`` flavour in the family's own table, so that model_registry("tiny") and its logs name it."""
    builder = _TINY_BUILDERS.get(name)
    if builder is not None:
        getattr(mod, FAMILIES[name].table).setdefault(TINY, builder)
    if name == "qwen3_5":
        _qwen3_5_text_batches(mod)
