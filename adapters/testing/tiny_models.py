"""Tiny random-weight models, built locally, for the demo, tests and benchmarks.

Model hubs are out of reach on CI machines; these build in seconds with
transformers alone. One word `w<n>` is one token, so prompt lengths and
block boundaries are exact. A large initializer range keeps greedy argmax
away from ties, so outputs compare exactly across code paths.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_WORDS = 1020
SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")
_COMMON = dict(vocab_size=len(SPECIALS) + VOCAB_WORDS, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, max_position_embeddings=4096, bos_token_id=2, eos_token_id=3, pad_token_id=0,
               tie_word_embeddings=False, initializer_range=0.2)

# name -> (architecture, layers, hidden, intermediate, extra config)
MODELS: dict[str, tuple[str, int, int, int, dict]] = {
    "tiny-llama": ("llama", 2, 128, 256, {}),
    "tiny-gemma3": ("gemma3", 4, 128, 256, {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "sliding_window": 64, "query_pre_attn_scalar": 32}),
    # Multi-head latent attention (DeepSeek-V2): one 576-wide latent per token, the
    # same on every tensor-parallel rank. vLLM-CPU's MLA kernel wants exactly 512 + 64.
    "tiny-deepseek-mla": ("deepseek_v2", 2, 128, 256, {
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
        "v_head_dim": 32, "first_k_dense_replace": 2, "n_routed_experts": 4, "n_shared_experts": 1,
        "moe_intermediate_size": 64, "num_experts_per_tok": 2, "num_key_value_heads": 4}),
    # Big enough that prefill costs real time on a CPU: the TTFT benchmark.
    # 45M parameters: a 2k-token prefill takes seconds on a CPU, as prefills do on real models.
    "small-llama": ("llama", 4, 1024, 2816, {"num_attention_heads": 16, "num_key_value_heads": 4,
                                             "head_dim": 64}),
    # For GPU benchmarks (about 0.75B parameters, random weights): a prefill that
    # costs an H100 tens of milliseconds, and 1 MiB of KV per 16-token block in bf16.
    "gpu-llama": ("llama", 16, 2048, 5632, {"num_attention_heads": 16, "num_key_value_heads": 8,
                                            "head_dim": 128, "max_position_embeddings": 16384}),
}


_CLASSES = {"llama": ("LlamaForCausalLM", "LlamaConfig"), "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
            "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config")}


def _tokenizer():
    # Building a model only: `kvledger --help` lists the models without loading these.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(VOCAB_WORDS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>", model_max_length=16384)


def build_model(name: str, root: str | Path) -> Path:
    """The model's folder under `root`, built on first use."""
    path = Path(root) / name
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    if name not in MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(MODELS)}")
    # Building a model only, as the tokenizer's.
    import torch
    import transformers

    arch, layers, hidden, intermediate, extra = MODELS[name]
    values = {**_COMMON, "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": intermediate,
              **extra}
    torch.manual_seed(0)
    model_class, config_class = _CLASSES[arch]
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**values))
    model.config.torch_dtype = "float32"
    tmp = path.with_name(path.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    _tokenizer().save_pretrained(tmp)
    (tmp / "kvledger-model.json").write_text(json.dumps({"name": name, "built_by": "kvledger"}))
    tmp.rename(path)
    return path
