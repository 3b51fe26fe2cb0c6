"""A tiny random Llama for real-engine tests: built locally in seconds, no download.

4 KV heads (8 query heads) of head size 32, so TP 2 splits KV heads 2 + 2 and
the CPU attention backend accepts the head size. Weights are drawn with a
larger spread than transformers' default so that greedy outputs depend on the
whole context (with the default, a random model repeats one token and a test
could not tell transferred KV from garbage). No tokenizer: engines run with
``skip_tokenizer_init`` and token-id prompts; ``tokenizer=True`` adds a word-level tokenizer
(token *i* is the word ``w<i>``) for servers that take text (the OpenAI API server).
"""

from __future__ import annotations

import random
import sys

LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 8, 4, 32, 1024  # 4 layers: 2 kvstage layers, streamed in 2 groups


def build(out: str, seed: int = 0, layers: int = LAYERS, heads: int = HEADS, kv_heads: int = KV_HEADS,
          head_dim: int = HEAD_DIM, intermediate: int = 512, max_len: int = 1024, tokenizer: bool = False) -> str:
    """Save a random Llama to ``out`` (the defaults are the tests' model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=heads * head_dim, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=max_len, initializer_range=0.15,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    LlamaForCausalLM(cfg).save_pretrained(out)
    if tokenizer:
        save_tokenizer(out)
    return out


SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")


def save_tokenizer(out: str) -> None:
    """A word-level tokenizer over the model's vocabulary: ids 0-3 are special, id i >= 4 is ``w<i>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)} | {f"w{i}": i for i in range(len(SPECIAL), VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(out)


def text(ids) -> str:
    """A prompt for the word-level tokenizer: its token ids are ``ids``."""
    return " ".join(f"w{i}" for i in ids)


def prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB) for _ in range(n)] for n in lengths]


if __name__ == "__main__":
    build(sys.argv[1])
