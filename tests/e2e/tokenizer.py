"""A small real tokenizer, trained here with `tokenizers` (nothing downloaded):
byte-level BPE with a BOS token, like the models the harness runs."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from vllm_overlay.e2e.prompts import FILLER_SENTENCES, HEADER


def corpus() -> list[str]:
    lines = [HEADER, *FILLER_SENTENCES]
    lines += [f"key {i:04d}: value {i * 7919 % 10**6:06d}" for i in range(0, 10**4, 37)]
    lines += ["What is the value of key 0042? The value is 123456"]
    lines += ["What is the special magic number in the text above? It is 7"]
    lines += ["The special magic number is 1234567."]
    lines += [" ".join(str(i) for i in range(1, 3000))]
    return lines


def build_tokenizer(path: Path) -> Path:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tok.save(str(path))
    return path
