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
    # Big enough that prefill costs real time on a CPU: the TTFT benchmark.
    # 45M parameters: a 2k-token prefill takes seconds on a CPU, as prefills do on real models.
    "small-llama": ("llama", 4, 1024, 2816, {"num_attention_heads": 16, "num_key_value_heads": 4,
                                             "head_dim": 64}),
    # For GPU benchmarks (about 0.75B parameters, random weights): a prefill that
    # costs an H100 tens of milliseconds, and 1 MiB of KV per 16-token block in bf16.
    "gpu-llama": ("llama", 16, 2048, 5632, {"num_attention_heads": 16, "num_key_value_heads": 8,
                                            "head_dim": 128, "max_position_embeddings": 16384}),
}


def _tokenizer():
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
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    arch, layers, hidden, intermediate, extra = MODELS[name]
    values = {**_COMMON, "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": intermediate,
              **extra}
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**values))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(**values))
    model.config.torch_dtype = "float32"
    tmp = path.with_name(path.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    _tokenizer().save_pretrained(tmp)
    (tmp / "kvledger-model.json").write_text(json.dumps({"name": name, "built_by": "kvledger"}))
    tmp.rename(path)
    return path
