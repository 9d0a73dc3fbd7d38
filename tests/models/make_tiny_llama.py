"""Write a tiny Llama-architecture model with random weights and its own BPE tokenizer.

Real architecture for the real engine, meaningless text: tests check structure (token counts,
finish reasons), never prose. Shape chosen for vLLM's CPU attention, which rejects head_dim 16
and accepts 64 (RUNTIME_NOTES.md): hidden 256, 4 heads, 2 KV heads, 2 layers.

    python tests/models/make_tiny_llama.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

CORPUS = [
    "The model serves requests through Triton and vLLM.",
    "A platform team rolls out new versions with zero downtime.",
    "Weights move from object storage to the shared file system.",
    "Red-black rollouts shift traffic in steps; versioned ones add a route.",
    '{"name": "value", "count": 3, "items": [1, 2, 3], "ok": true}',
    "The quick brown fox jumps over the lazy dog 0123456789.",
] * 20


def make(out: Path, seed: int = 0, context: int = 512) -> Path:
    """Create the model folder at ``out`` (config.json, model.safetensors, tokenizer files).
    ``context``: max_position_embeddings, the longest max_model_len vLLM accepts for it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=context,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))
