// The byte-level BPE tokenizer against the tokenizers library (a tiny trained tokenizer in
// tests/fixtures/tiny-tokenizer) and, when it is in the model cache, against transformers
// reading SmolLM2-135M-Instruct's GGUF file.

#include "model/tokenizer.hpp"
#include "tests/generation.hpp"
#include "troupe/errors.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include <unistd.h>

using namespace troupe;
using troupe::testing::read_json;

namespace {

const std::string fixtures = TROUPE_SOURCE_DIR "/tests/fixtures";

std::string random_utf8(std::mt19937& rng, size_t chars) {
  // Code points from every plane that UTF-8 encodes, surrogates left out.
  std::uniform_int_distribution<int> kind{0, 4};
  std::string s;
  for (size_t i = 0; i < chars; ++i) {
    uint32_t cp = 0;
    switch (kind(rng)) {
    case 0:
      cp = std::uniform_int_distribution<uint32_t>{0, 0x7f}(rng);
      break;
    case 1:
      cp = std::uniform_int_distribution<uint32_t>{0x80, 0x7ff}(rng);
      break;
    case 2:
      cp = std::uniform_int_distribution<uint32_t>{0x800, 0xd7ff}(rng);
      break;
    case 3:
      cp = std::uniform_int_distribution<uint32_t>{0xe000, 0xfffd}(rng);
      break;
    default:
      cp = std::uniform_int_distribution<uint32_t>{0x10000, 0x10ffff}(rng);
    }
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      s.push_back(static_cast<char>(0xc0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else if (cp < 0x10000) {
      s.push_back(static_cast<char>(0xe0 | (cp >> 12)));
      s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else {
      s.push_back(static_cast<char>(0xf0 | (cp >> 18)));
      s.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
      s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    }
  }
  return s;
}

} // namespace

TEST_CASE("encodings match the tokenizers library") {
  auto tok = tokenizer::from_json(fixtures + "/tiny-tokenizer/tokenizer.json");
  for (auto& sample : read_json(fixtures + "/tiny-tokenizer/reference.json")) {
    auto text = sample["text"].get<std::string>();
    auto want = sample["ids"].get<std::vector<int32_t>>();
    CHECK_MESSAGE(tok.encode(text) == want, nlohmann::json(text).dump());
    CHECK(tok.decode(want) == text);
  }
}

TEST_CASE("any UTF-8 text round-trips exactly") {
  auto tok = tokenizer::from_json(fixtures + "/tiny-tokenizer/tokenizer.json");
  std::mt19937 rng{11};
  for (int i = 0; i < 200; ++i) {
    auto text = random_utf8(rng, static_cast<size_t>(i % 40));
    CHECK(tok.decode(tok.encode(text, false)) == text);
  }
}

TEST_CASE("special tokens split the text and can be skipped when decoding") {
  auto tok = tokenizer::from_json(fixtures + "/tiny-tokenizer/tokenizer.json");
  auto start = tok.token_id("<|im_start|>");
  REQUIRE(start >= 0);
  CHECK(tok.is_special(start));
  auto ids = tok.encode("<|im_start|>user");
  CHECK(ids.front() == start);
  CHECK(tok.decode(ids, true) == "user");
  // Without parsing, the marker is ordinary text.
  CHECK(tok.encode("<|im_start|>", false).size() > 1);
}

TEST_CASE("bad input is an error, not a crash") {
  auto tok = tokenizer::from_json(fixtures + "/tiny-tokenizer/tokenizer.json");
  CHECK_THROWS_WITH_AS(tok.encode("\xff\xfe"), doctest::Contains("not valid UTF-8"), error);
  CHECK_THROWS_WITH_AS(tok.encode("ab\xe3\x81"), doctest::Contains("not valid UTF-8"), error);
  CHECK_THROWS_WITH_AS(tok.decode({100000}), doctest::Contains("outside the vocabulary"), error);
  CHECK_THROWS_AS(tokenizer::from_json("/nonexistent/tokenizer.json"), error);
  CHECK_THROWS_AS(tokenizer::from_json(fixtures + "/llama-gqa/config.json"), error);
}

TEST_CASE("SmolLM2's GGUF tokenizer gives the token ids of transformers") {
  auto model = troupe::testing::smollm2_or_skip();
  if (model.empty())
    return;
  auto tok = tokenizer::from_gguf(model.string());
  CHECK(tok.vocab_size() == 49152);
  CHECK(tok.eos_id() == 2);
  CHECK(tok.token_text(tok.eos_id()) == "<|im_end|>");
  // Kept in a variable: a range over a temporary's member outlives the temporary.
  auto reference = read_json(fixtures + "/smollm2-reference.json");
  for (auto& run : reference["runs"]) {
    auto text = run["text"].get<std::string>();
    CHECK_MESSAGE(tok.encode(text) == run["token_ids"].get<std::vector<int32_t>>(), text);
    CHECK(tok.decode(run["greedy"].get<std::vector<int32_t>>()) ==
          run["continuation"].get<std::string>());
  }
}

TEST_CASE("broken UTF-8 decodes as transformers decodes it: one U+FFFD per broken sequence") {
  auto ref = read_json(fixtures + "/utf8-decode.json"); // scripts/make-utf8-fixture.py
  for (auto& c : ref["bytes"]) {
    auto hex = c["hex"].get<std::string>();
    std::string bytes;
    for (size_t i = 0; i + 1 < hex.size(); i += 2)
      bytes.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    CHECK_MESSAGE(valid_utf8(bytes) == c["text"].get<std::string>(), hex);
  }
  // Ids cut inside a character (an emoji over two tokens, as a generation can stop): the
  // text is still valid UTF-8, so it can go into JSON.
  auto tok = tokenizer::from_json(fixtures + "/tiny-tokenizer/tokenizer.json");
  for (auto& c : ref["tokens"]) {
    auto ids = c["ids"].get<std::vector<int32_t>>();
    auto text = tok.decode(ids);
    CHECK_MESSAGE(text == c["text"].get<std::string>(), nlohmann::json(ids).dump());
    CHECK_NOTHROW((void)nlohmann::json(text).dump());
  }
}

namespace {

/// A pipeline fixture (scripts/make-tokenizer-fixtures.py) against its reference from
/// transformers: ids with and without the template, and the text the ids decode to.
void check_pipeline(const tokenizer& tok, const std::string& name) {
  for (auto& sample : read_json(fixtures + "/tokenizer-pipelines/" + name + "/reference.json")) {
    auto text = sample["text"].get<std::string>();
    INFO(name << ": " << nlohmann::json(text).dump());
    CHECK(tok.encode(text) == sample["ids"].get<std::vector<int32_t>>());
    auto with_special = sample["ids_with_special"].get<std::vector<int32_t>>();
    CHECK(tok.encode(text, true, true) == with_special);
    CHECK(tok.decode(with_special) == sample["decoded"].get<std::string>());
    CHECK(tok.decode(with_special, true) == sample["decoded_skip_special"].get<std::string>());
  }
}

const char* const byte_level_pipelines[] = {"qwen2", "llama3", "smollm"};

} // namespace

TEST_CASE(
  "tokenizer.json pipelines as Qwen2, Llama 3 and SmolLM2 ship them give transformers' ids") {
  // Qwen2's NFC and Split regex; Llama 3's Split regex, whole-word lookup and the template
  // that puts <|begin_of_text|> first; SmolLM2's single digits (Unicode's, not ASCII's).
  for (std::string name : byte_level_pipelines)
    check_pipeline(
      tokenizer::from_json(fixtures + "/tokenizer-pipelines/" + name + "/tokenizer.json"), name);
}

TEST_CASE(
  "a GGUF file's tokenizer.ggml.pre names the pipeline of the tokenizer.json it came from") {
  // The same tokenizers written as GGUF files with llama.cpp's names (qwen2, llama-bpe,
  // smollm): the same ids as their tokenizer.json.
  for (std::string name : byte_level_pipelines)
    check_pipeline(
      tokenizer::from_gguf(fixtures + "/tokenizer-pipelines/" + name + "/tokenizer.gguf"), name);
}

TEST_CASE("SentencePiece BPE with byte fallback, as Llama 2 and Mistral ship it") {
  // One SentencePiece model (its ids checked against SentencePiece's own when the fixture
  // was made) in the tokenizer.json layout of Llama 2 (Prepend and Replace normalizers)
  // and of newer files (Metaspace, prefix only first), and as a GGUF file's pieces and
  // scores (which llama.cpp encodes as Llama 2's layout does).
  auto dir = fixtures + "/tokenizer-pipelines/";
  check_pipeline(tokenizer::from_json(dir + "llama2/tokenizer.json"), "llama2");
  check_pipeline(tokenizer::from_json(dir + "mistral/tokenizer.json"), "mistral");
  auto gguf = tokenizer::from_gguf(dir + "llama2/tokenizer.gguf");
  CHECK(gguf.bos_id() == 1);
  CHECK(gguf.eos_id() == 2);
  check_pipeline(gguf, "llama2");
  // A long prompt is one piece to SentencePiece: merging stays fast and exact.
  std::string text;
  for (int i = 0; i < 400; ++i)
    text += "The quick brown fox jumps over the lazy dog. ";
  auto ids = gguf.encode(text);
  CHECK(ids.size() < text.size() / 2);
  CHECK(gguf.decode(ids) == text.substr(0, text.size() - 1) + " ");
}

TEST_CASE("a SentencePiece model file (tokenizer.model) encodes and decodes as SentencePiece") {
  // The fixture's model as is (Llama 2's settings: spaces kept) and with SentencePiece's
  // removal of extra spaces; SentencePiece never reads special tokens from the text.
  auto dir = fixtures + "/tokenizer-pipelines/sentencepiece/";
  auto reference = read_json(dir + "reference.json");
  for (std::string name : {"tokenizer.model", "tokenizer-trim.model"}) {
    auto tok = tokenizer::from_sentencepiece(dir + name);
    CHECK(tok.bos_id() == 1);
    CHECK(tok.eos_id() == 2);
    for (auto& c : reference[name]) {
      INFO(name << ": " << c["text"].dump());
      auto ids = c["ids"].get<std::vector<int32_t>>();
      if (c["text"].is_string())
        CHECK(tok.encode(c["text"].get<std::string>(), false) == ids);
      CHECK(tok.decode(ids) == c["decoded"].get<std::string>());
    }
    CHECK(tok.encode("a", false, true).front() == 1); // <s> first
  }
  // A file that is not a SentencePiece model is named in the error.
  CHECK_THROWS_WITH_AS(tokenizer::from_sentencepiece(fixtures + "/llama-gqa/config.json"),
                       doctest::Contains("llama-gqa/config.json' is not well-formed"), error);
  CHECK_THROWS_WITH_AS(tokenizer::from_sentencepiece(dir + "missing.model"),
                       doctest::Contains("missing.model': No such file"), error);
}

TEST_CASE("a malformed or hostile tokenizer file is an error naming it, never a crash") {
  auto original = read_json(fixtures + "/tokenizer-pipelines/llama3/tokenizer.json");
  auto path = (std::filesystem::temp_directory_path() /
               ("troupe-hostile-" + std::to_string(::getpid()) + ".json"))
                .string();
  auto refused = [&](const std::function<void(nlohmann::json&)>& change, const char* what) {
    auto j = original;
    change(j);
    std::ofstream{path} << j.dump();
    CHECK_THROWS_WITH_AS(tokenizer::from_json(path), doctest::Contains(what), error);
  };
  refused([](nlohmann::json& j) { j["post_processor"]["processors"][1]["single"][0] = 5; },
          "is malformed");
  refused([](nlohmann::json& j) { j["added_tokens"][0]["id"] = int64_t{1} << 31; },
          "beyond any vocabulary");
  refused([](nlohmann::json& j) { j["model"]["merges"][0] = 7; }, "is neither");
  refused(
    [](nlohmann::json& j) {
      j["decoder"] = {{"type", "Strip"}, {"content", ""}, {"start", 1000000000}, {"stop", 0}};
    },
    "decoder Strip has no content");
  refused(
    [](nlohmann::json& j) {
      nlohmann::json nested = {{"type", "NFC"}};
      for (int i = 0; i < 40; ++i)
        nested = {{"type", "Sequence"}, {"normalizers", {nested}}};
      j["normalizer"] = nested;
    },
    "more than 16 deep");
  std::filesystem::remove(path);

  // A SentencePiece model whose one piece scores NaN (protobuf written by hand: piece "a"
  // with score NaN, a BPE trainer spec with <unk> at 0 and no <s> or </s>).
  auto bytes = [](auto& literal) { return std::string(literal, sizeof literal - 1); };
  auto piece = bytes("\x0a\x01"
                     "a"
                     "\x15\x00\x00\xc0\x7f"
                     "\x18\x01");
  auto minus_one = bytes("\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01");
  auto spec = bytes("\x18\x02"
                    "\xc0\x02\x00"
                    "\xc8\x02") +
              minus_one + bytes("\xd0\x02") + minus_one;
  auto model = bytes("\x0a") + std::string(1, static_cast<char>(piece.size())) + piece +
               bytes("\x12") + std::string(1, static_cast<char>(spec.size())) + spec;
  auto sp_path = path + ".model";
  std::ofstream{sp_path, std::ios::binary} << model;
  CHECK_THROWS_WITH_AS(tokenizer::from_sentencepiece(sp_path),
                       doctest::Contains("not a finite number"), error);
  std::filesystem::remove(sp_path);
}

TEST_CASE("the project's GGUF fixtures, with placeholder SentencePiece vocabularies, load") {
  // Their pieces are <t0>, <t1>, …: no text can be encoded, but the tokenizer loads, so
  // prompts of token ids work, and ids decode to the pieces.
  auto tok = tokenizer::from_gguf(fixtures + "/llama-gqa-gguf/llama-gqa-q8_0.gguf");
  CHECK(tok.decode({5, 6}) == "<t5><t6>");
  CHECK_THROWS_WITH_AS(tok.encode("hi"), doctest::Contains("and no unknown token"), error);
}

TEST_CASE("a tokenizer.json step of an unknown type is refused with its name") {
  auto original = read_json(fixtures + "/tokenizer-pipelines/llama3/tokenizer.json");
  auto path = (std::filesystem::temp_directory_path() /
               ("troupe-tokenizer-" + std::to_string(::getpid()) + ".json"))
                .string();
  auto refused = [&](const char* key, nlohmann::json step, const std::string& name) {
    auto j = original;
    j[key] = std::move(step);
    std::ofstream{path} << j.dump();
    auto quoted = "'" + name + "'";
    CHECK_THROWS_WITH_AS(tokenizer::from_json(path), doctest::Contains(quoted.c_str()), error);
  };
  refused("normalizer", {{"type", "Lowercase"}}, "Lowercase");
  refused("pre_tokenizer", {{"type", "Whitespace"}}, "Whitespace");
  refused("post_processor", {{"type", "RobertaProcessing"}}, "RobertaProcessing");
  refused("decoder", {{"type", "WordPiece"}}, "WordPiece");
  auto model = original["model"];
  original["model"] = {{"type", "Unigram"}, {"vocab", nlohmann::json::array()}};
  refused("decoder", original["decoder"], "Unigram");
  original["model"] = model;
  std::filesystem::remove(path);
}
