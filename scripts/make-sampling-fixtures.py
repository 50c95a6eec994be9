"""Fixtures for vLLM's sampling parameters (tests/fixtures/sampling.json): what the logits
become under bad words, logit_bias, min_tokens, repetition, frequency and presence penalties,
and which tokens min_p keeps, for random logits and a token history; the token sequences of
bad_words with tests/fixtures/tiny-tokenizer; and greedy continuations of the llama-gqa
fixture under penalties and bad words.

References: transformers' RepetitionPenaltyLogitsProcessor, MinPLogitsWarper and
NoBadWordsLogitsProcessor where they exist (vLLM's repetition penalty, min_p and bad words
have the same definitions, bad words over the output's tokens); a small re-implementation of
vLLM's frequency and presence penalties, logit_bias, min_tokens (its sampler: output-token
counts, subtracted; bias added first; stop tokens at -inf while the output is short) and of
its tokenization of bad_words (the word, and after a space where that starts with another
token), in vLLM's order.

    python scripts/make-sampling-fixtures.py"""
import json
import os

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers.generation.logits_process import (MinPLogitsWarper,
                                                    NoBadWordsLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor)

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "tests", "fixtures")


def vllm_process(logits, prompt, output, p):
    """vLLM's processing before the temperature, on a float32 copy."""
    x = torch.tensor(logits, dtype=torch.float32).clone()
    words = p.get("bad_words_token_ids", [])
    if words:
        # vLLM looks at the output only: the prompt's place is held by a token (-1) that
        # matches no word.
        past = torch.tensor([[-1] + output])
        x = NoBadWordsLogitsProcessor(words, eos_token_id=None)(past, x[None, :])[0]
    for tok, bias in zip(p.get("logit_bias_ids", []), p.get("logit_bias_values", [])):
        x[tok] += bias
    if len(output) < p.get("min_tokens", 0):
        for tok in p.get("stop_ids", []):
            x[tok] = -float("inf")
    rep = p.get("repetition_penalty", 1.0)
    if rep != 1.0:
        ids = torch.tensor([prompt + output])
        x = RepetitionPenaltyLogitsProcessor(rep)(ids, x[None, :])[0]
    counts = np.bincount(output, minlength=len(logits)) if output else np.zeros(len(logits))
    counts = torch.tensor(counts, dtype=torch.float32)
    x = x - p.get("frequency_penalty", 0.0) * counts
    x = x - p.get("presence_penalty", 0.0) * (counts > 0).float()
    return x


def main():
    rng = np.random.default_rng(7)
    vocab = 48
    logits = (rng.standard_normal(vocab) * 2).astype(np.float32).tolist()
    prompt = [3, 5, 7, 5, 11]
    output = [7, 20, 20, 20, 31, 3]
    cases = []
    for p in [{"repetition_penalty": 1.8},
              {"repetition_penalty": 0.7},
              {"frequency_penalty": 1.5},
              {"presence_penalty": -0.5},
              {"frequency_penalty": 0.4, "presence_penalty": 1.1, "repetition_penalty": 1.3},
              {"logit_bias_ids": [0, 20, 47], "logit_bias_values": [100.0, -100.0, 3.5]},
              {"min_tokens": 8, "stop_ids": [2, 9]},
              {"min_tokens": 6, "stop_ids": [2, 9]},
              {"logit_bias_ids": [20], "logit_bias_values": [2.0], "repetition_penalty": 2.0,
               "frequency_penalty": -1.0},
              # One token; a word the output's last two tokens begin; one its last begins;
              # one whose beginning is in the prompt only (not banned).
              {"bad_words_token_ids": [[20], [31, 3, 8], [3, 9], [5, 7, 44]]},
              {"bad_words_token_ids": [[7, 20, 20, 20, 31, 3, 12], [13]],
               "repetition_penalty": 1.4}]:
        processed = vllm_process(logits, prompt, output, p)
        # -inf (a held-back stop token) as null: JSON has no infinity.
        cases.append({"params": p, "processed": [None if np.isinf(float(v)) else float(v)
                                                 for v in processed]})
    # min_p: the tokens kept at a temperature (MinPLogitsWarper on logits / temperature).
    min_p_cases = []
    for min_p, temperature in [(0.1, 1.0), (0.5, 1.0), (0.05, 0.5), (0.3, 2.0)]:
        scaled = torch.tensor(logits)[None, :] / temperature
        kept = MinPLogitsWarper(min_p)(None, scaled)[0]
        min_p_cases.append({"min_p": min_p, "temperature": temperature,
                            "kept": [i for i in range(vocab) if kept[i] != -float("inf")]})

    # bad_words as vLLM tokenizes them, with the tiny tokenizer.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(FIXTURES, "tiny-tokenizer", "tokenizer.json"))
    words = ["hello", "  world", "the cat", "«x»", "ab"]
    word_ids = []
    for word in words:
        for add_prefix_space in [False, True]:
            ids = tokenizer.encode(("" if not add_prefix_space else " ") + word.lstrip(),
                                   add_special_tokens=False)
            if not add_prefix_space or (ids[0] != word_ids[-1][0]
                                        and len(ids) == len(word_ids[-1])):
                word_ids.append(ids)

    # Greedy continuations of llama-gqa under penalties.
    model_dir = os.path.join(FIXTURES, "llama-gqa")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start = [1, 15, 27, 99, 3, 15, 27]

    def run(p):
        ids = list(start)
        out = []
        with torch.no_grad():
            for _ in range(16):
                last = model(torch.tensor([ids])).logits[0, -1]
                x = vllm_process(last.tolist(), start, out, p)
                tok = int(torch.argmax(x))
                out.append(tok)
                ids.append(tok)
        return out

    plain = run({})
    greedy = []
    for p in [{"repetition_penalty": 1.8},
              {"frequency_penalty": 1.5, "presence_penalty": 0.5},
              {"repetition_penalty": 1.2, "frequency_penalty": 0.3, "presence_penalty": 0.2,
               "logit_bias_ids": [7], "logit_bias_values": [1.5]},
              # Two words of the plain run's own tokens: the run turns where it completes
              # the first.
              {"bad_words_token_ids": [[plain[3], plain[4]], [plain[9], plain[10], plain[11]]]}]:
        greedy.append({"params": p, "prompt": start, "tokens": run(p)})
    assert greedy[-1]["tokens"][:4] == plain[:4] and greedy[-1]["tokens"][4] != plain[4]
    # transformers' own generate agrees on the repetition penalty alone.
    with torch.no_grad():
        hf = model.generate(torch.tensor([start]), attention_mask=torch.ones(1, len(start)),
                            max_new_tokens=16, do_sample=False, repetition_penalty=1.8,
                            eos_token_id=None, pad_token_id=0)[0, len(start):].tolist()
    assert hf == greedy[0]["tokens"], (hf, greedy[0]["tokens"])
    with open(os.path.join(FIXTURES, "sampling.json"), "w") as f:
        json.dump({"vocab": vocab, "logits": logits, "prompt": prompt, "output": output,
                   "cases": cases, "min_p": min_p_cases, "greedy": greedy,
                   "bad_words": {"words": words, "token_ids": word_ids}}, f, allow_nan=False)
    print(len(cases), "processing cases,", len(min_p_cases), "min_p cases,", len(greedy),
          "greedy runs")


if __name__ == "__main__":
    main()
