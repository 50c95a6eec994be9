#!/usr/bin/env python3
"""Writes tests/fixtures/utf8-decode.json: how text with broken UTF-8 is decoded the way
transformers decodes it (each invalid or incomplete sequence becomes one U+FFFD): byte
strings through Python's codec, and the tiny tokenizer's ids cut inside a character through
the tokenizers library. CI only reads the committed file:

    pip install tokenizers
    python3 scripts/make-utf8-fixture.py
"""
import json
import pathlib

from tokenizers import Tokenizer

fixtures = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"

# Truncated characters, stray continuation bytes, overlong forms, surrogates, values past
# U+10FFFF, bytes that never occur, and good text around them.
raw = [b"ok", b"\xe2\x82", b"\xf0\x9f\x98", b"a\x80b", b"\xc0\xaf", b"\xe0\x80\xaf",
       b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xff\xfe", b"\xf0\x9f\x98\x80\xf0\x9f",
       b"\xe2\x82\xac\xe2", b"\xc3", b"\xf1\x80\x80\xe1\x80\xc2", "caf\u00e9 \u4e2d\u6587".encode()]
bytes_cases = [{"hex": b.hex(), "text": b.decode("utf-8", "replace")} for b in raw]

tok = Tokenizer.from_file(str(fixtures / "tiny-tokenizer" / "tokenizer.json"))
token_cases = []
for text in ["\U0001F600 smile", "\u4e2d\u6587 and \u00e9t\u00e9", "\U0001F468\u200d\U0001F469"]:
    ids = tok.encode(text, add_special_tokens=False).ids
    for cut in range(1, len(ids) + 1):
        token_cases.append({"ids": ids[:cut], "text": tok.decode(ids[:cut])})

with open(fixtures / "utf8-decode.json", "w") as f:
    json.dump({"bytes": bytes_cases, "tokens": token_cases}, f, indent=1)
print("wrote", fixtures / "utf8-decode.json")
