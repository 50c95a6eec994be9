#!/usr/bin/env python3
"""Writes tests/fixtures/tokenizer-pipelines: tiny tokenizers built the way real families'
files are, trained on a small corpus, with their encodings and decodings of tricky texts
from transformers (which runs the tokenizers library). CI only reads the committed files:

    pip install tokenizers transformers sentencepiece protobuf gguf
    python3 scripts/make-tokenizer-fixtures.py

- qwen2: NFC, Qwen2's Split regex, byte-level BPE.
- llama3: Llama 3's Split regex, byte-level BPE that looks whole words up first
  (ignore_merges), a template that puts <|begin_of_text|> first.
- smollm: SmolLM2's single digits and GPT-2's byte-level pattern.
- llama2: a SentencePiece BPE model with byte fallback, as Llama 2 and Mistral 7B v0.1 ship
  it in tokenizer.json (normalizer "▁" prepended and spaces replaced, decoder chain of
  Replace, ByteFallback, Fuse, Strip; <s> first); its ids are checked against SentencePiece.
- mistral: the same model in the newer layout (Metaspace pre-tokenizer, prefix only first).
- sentencepiece: the model file itself (tokenizer.model), as is and with SentencePiece's
  removal of extra spaces switched on, with SentencePiece's own ids and decodings.

Each byte-level one is also written as a GGUF file's tokenizer with the `tokenizer.ggml.pre`
name llama.cpp's converter gives it; llama2 is written as a SentencePiece GGUF
(`tokenizer.ggml.model` llama: pieces, scores, token types).
"""
import json
import pathlib
import tempfile

import gguf
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)
from transformers import PreTrainedTokenizerFast

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
    " leading space", "▁ a literal meta space ▁▁", "<s>starts special</s> then text <s>",
    "unseen: Ωψζ ӁӜ ∰ 🦀",
]
BYTE_LEVEL_SPECIALS = ["<|begin_of_text|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_reference(directory, tok_file, bos_first):
    """Ids with and without the template, and decodings, from transformers."""
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_file))
    reference = []
    for s in samples:
        ids = hf.encode(s, add_special_tokens=False)
        with_special = hf.encode(s, add_special_tokens=True)
        reference.append({"text": s, "ids": ids, "ids_with_special": with_special,
                          "decoded": hf.decode(with_special),
                          "decoded_skip_special": hf.decode(with_special, skip_special_tokens=True)})
    with open(directory / "reference.json", "w") as f:
        json.dump(reference, f, ensure_ascii=False, indent=1)
    return reference


def write_gguf(path, model, tokens, types, **extra):
    """A GGUF file that holds only a tokenizer."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if "pre" in extra:
        w.add_tokenizer_pre(extra["pre"])
    if "merges" in extra:
        w.add_token_merges(extra["merges"])
    if "scores" in extra:
        w.add_token_scores(extra["scores"])
    for key in ("bos", "eos", "unk"):
        if key in extra:
            getattr(w, f"add_{key}_token_id")(extra[key])
    if "add_bos" in extra:
        w.add_add_bos_token(extra["add_bos"])
    if "add_space_prefix" in extra:
        w.add_add_space_prefix(extra["add_space_prefix"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build_byte_level(name, normalizer, pre, template, ignore_merges, gguf_pre):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=BYTE_LEVEL_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    post = processors.ByteLevel(trim_offsets=False)
    bos = tok.token_to_id("<|begin_of_text|>")
    if template:
        post = processors.Sequence([post, processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)])])
    tok.post_processor = post
    directory = out / name
    directory.mkdir(exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    write_reference(directory, directory / "tokenizer.json", template)
    saved = json.loads((directory / "tokenizer.json").read_text())
    vocab = saved["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in saved["model"]["merges"]]
    types = [3 if t in BYTE_LEVEL_SPECIALS else 1 for t in tokens]
    write_gguf(directory / "tokenizer.gguf", "gpt2", tokens, types, pre=gguf_pre, merges=merges,
               bos=bos, eos=tok.token_to_id("<|endoftext|>"), add_bos=template)
    print("wrote", directory)


build_byte_level("qwen2", normalizers.NFC(), pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(QWEN2), behavior="isolated", invert=False),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    template=False, ignore_merges=False, gguf_pre="qwen2")
build_byte_level("llama3", None, pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    template=True, ignore_merges=True, gguf_pre="llama-bpe")
build_byte_level("smollm", None, pre_tokenizers.Sequence([
    pre_tokenizers.Digits(individual_digits=True),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    template=False, ignore_merges=False, gguf_pre="smollm")

# -- SentencePiece: one BPE model with byte fallback, in the layouts that ship it ---------
with tempfile.TemporaryDirectory() as tmp:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_prefix=f"{tmp}/sp", vocab_size=700,
        model_type="bpe", byte_fallback=True, split_digits=True, add_dummy_prefix=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity",
        allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        max_sentence_length=100000, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=f"{tmp}/sp.model")
    proto = sp_pb2.ModelProto()
    proto.ParseFromString(open(f"{tmp}/sp.model", "rb").read())
directory = out / "sentencepiece"
directory.mkdir(exist_ok=True)
reference = {}
for name, trim in (("tokenizer.model", False), ("tokenizer-trim.model", True)):
    proto.normalizer_spec.remove_extra_whitespaces = trim
    (directory / name).write_bytes(proto.SerializeToString())
    processor = spm.SentencePieceProcessor(model_file=str(directory / name))
    cases = []
    for s in samples + ["🦀", "   "]:
        ids = processor.encode(s)
        cases.append({"text": s, "ids": ids, "decoded": processor.decode(ids)})
    # Ids cut inside a character: SentencePiece's own text for the broken bytes.
    cut = processor.encode("🦀")[:-1]
    cases.append({"text": None, "ids": cut, "decoded": processor.decode(cut)})
    reference[name] = cases
proto.normalizer_spec.remove_extra_whitespaces = False
with open(directory / "reference.json", "w") as f:
    json.dump(reference, f, ensure_ascii=False, indent=1)
print("wrote", directory)
pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
# Merges as transformers' converter makes them: every split of a normal piece into two
# normal pieces, ranked by the piece's score.
normal = {piece: (score, i) for i, (piece, score, kind) in enumerate(pieces) if kind == 1}
ranked = sorted((-score, i, piece[:k], piece[k:]) for piece, (score, i) in normal.items()
                for k in range(1, len(piece)) if piece[:k] in normal and piece[k:] in normal)
merges = [(left, right) for _, _, left, right in ranked]
spm_specials = ["<unk>", "<s>", "</s>"]


def sentencepiece_tokenizer(legacy):
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                               byte_fallback=True))
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in spm_specials])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


for name, legacy in (("llama2", True), ("mistral", False)):
    directory = out / name
    directory.mkdir(exist_ok=True)
    sentencepiece_tokenizer(legacy).save(str(directory / "tokenizer.json"))
    reference = write_reference(directory, directory / "tokenizer.json", True)
    if legacy:  # the layout is SentencePiece's own encoding where no special token is written
        for r in reference:
            if "<s>" not in r["text"] and "</s>" not in r["text"]:
                assert r["ids"] == sp.encode(r["text"]), r["text"]
    print("wrote", directory)

write_gguf(out / "llama2" / "tokenizer.gguf", "llama", [p for p, _, _ in pieces],
           [kind for _, _, kind in pieces], scores=[score for _, score, _ in pieces],
           bos=1, eos=2, unk=0, add_bos=True, add_space_prefix=True)
