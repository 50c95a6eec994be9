#!/usr/bin/env python3
"""Writes tests/fixtures/tokenizer-pipelines: tiny tokenizers whose tokenizer.json pipelines
are built as Qwen2's and Llama 3's are (Qwen2: NFC, its Split regex, byte-level; Llama 3:
its Split regex, byte-level, a template that puts <|begin_of_text|> first), trained on a
small corpus, and their encodings of tricky texts from the tokenizers library. CI only reads
the committed files:

    pip install tokenizers
    python3 scripts/make-tokenizer-fixtures.py
"""
import json
import pathlib

from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors, trainers)

out = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tokenizer-pipelines"
out.mkdir(parents=True, exist_ok=True)

# The Split patterns of the published tokenizer.json files.
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
         r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

corpus = [
    "The quick brown fox jumps over the lazy dog. It's 2024, isn't it? I'M SURE WE'LL SEE.",
    "Grüße aus München! Ça va? naïve café, résumé, façade; Ünïcödé.",
    "日本語のテキストと中文文本, 한국어 텍스트, русский текст, ελληνικά.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Emoji 😀🎉👍🏽 and symbols ∑∫√ ±×÷ — “quotes” ‘single’ …",
    "   leading spaces, trailing spaces   \n\n\ttabs\tand\r\nwindows lines 1234567 89",
] * 20
samples = [
    "", " ", "a", "Hello, world!", "I'M here, DON'T go; it's 'S fine",
    "numbers 1234567890, 3.14159 and 12 345 and ٣٤٥ and Ⅻ",
    "whitespace   runs\t\t and\n\n\nnew lines \r\n end  ",
    "accents: e\u0301 (decomposed) é (composed) A\u030a ﬁ",
    "CJK 中文文本和日本語 한국어", "emoji 😀🎉👍🏽 🇫🇷 👨\u200d👩\u200d👧",
    "punctuation!!! ... ?!? (parens) [brackets] {braces} <tags> --- ___",
    "<|im_start|>user\nHi<|im_end|>",
]


def build(name, normalizer, pattern, template):
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    post = processors.ByteLevel(trim_offsets=False)
    if template:
        bos = tok.token_to_id("<|begin_of_text|>")
        post = processors.Sequence([post, processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)])])
    tok.post_processor = post
    directory = out / name
    directory.mkdir(exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    reference = [{"text": s,
                  "ids": tok.encode(s, add_special_tokens=False).ids,
                  "ids_with_special": tok.encode(s, add_special_tokens=True).ids}
                 for s in samples]
    with open(directory / "reference.json", "w") as f:
        json.dump(reference, f, ensure_ascii=False, indent=1)
    print("wrote", directory)


build("qwen2", normalizers.NFC(), QWEN2, template=False)
build("llama3", None, LLAMA3, template=True)
