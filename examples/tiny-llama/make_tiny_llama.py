"""Make the embedded tiny Llama: train its tokenizer on the bundled corpus and write its config.

No weights are shipped: `examples/finetune.py` initialises the model from `config.json` with a
fixed seed (or loads a real model with `--model DIR`). Rerun this after changing the corpus:

    python examples/tiny-llama/make_tiny_llama.py

The tokenizer is a byte-level BPE (like GPT-2's and Llama 3's: any text encodes, nothing maps to
an unknown token) with 768 tokens, which makes every word of the toy corpus a single token.
`<s>` is prepended by the post-processor, so `tokenizer(text)` matches what training sees;
`</s>` ends each training document.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
SPECIAL = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2


def train_tokenizer(files: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train(files, trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", nargs="+", default=[str(HERE.parent / "data" / "train.txt")])
    parser.add_argument("--vocab-size", type=int, default=768)
    parser.add_argument("--out-dir", type=Path, default=HERE)
    args = parser.parse_args()

    from transformers import LlamaConfig, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(args.data, args.vocab_size),
                                        bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=256)
    tokenizer.save_pretrained(str(args.out_dir))
    # transformers 5 names its own class here; the older name loads on 4.x and 5.x alike.
    config_file = args.out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(tokenizer_config, indent=2) + "\n")

    # ~0.3M parameters: 4 layers, grouped-query attention. Untied embeddings (as in Llama 2/3 8B), so
    # a LoRA adapter on the randomly initialised model can adapt `lm_head` without touching the input
    # embeddings.
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=192, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.save_pretrained(str(args.out_dir))
    print(f"wrote {args.out_dir}: vocabulary {len(tokenizer)}, "
          f"{sum(1 for _ in open(args.data[0], encoding='utf-8'))} training documents")


if __name__ == "__main__":
    main()
