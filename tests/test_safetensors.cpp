// The safetensors reader and writer, against a file written by PyTorch's safetensors
// package (tests/fixtures, made by scripts/make-reference-fixtures.py), and every way a
// file can be broken.

#include "kernels/dtype.hpp"
#include "model/safetensors.hpp"
#include "troupe/errors.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <unistd.h>

using namespace troupe;
namespace fs = std::filesystem;

namespace {

const std::string fixtures = TROUPE_SOURCE_DIR "/tests/fixtures";

struct expected_tensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

std::map<std::string, expected_tensor> read_expected() {
  std::ifstream in{fixtures + "/dtypes.expected.txt"};
  std::map<std::string, expected_tensor> result;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#')
      continue;
    std::istringstream fields{line};
    std::string name;
    std::string shape;
    std::string colon;
    expected_tensor t;
    fields >> name >> t.dtype >> shape >> colon;
    std::istringstream dims{shape};
    for (std::string d; std::getline(dims, d, 'x');)
      t.shape.push_back(std::stoll(d));
    for (std::string v; fields >> v;)
      t.values.push_back(std::stof(v));
    result[name] = t;
  }
  return result;
}

std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("troupe-st-" + std::to_string(getpid()) + "-" + name))
    .string();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out{path, std::ios::binary};
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string with_header(const std::string& json, const std::string& data) {
  std::string result(8, '\0');
  uint64_t len = json.size();
  for (int i = 0; i < 8; ++i)
    result[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  return result + json + data;
}

std::string error_of(const std::string& path) {
  try {
    safetensors_file file{path};
  } catch (const error& e) {
    CHECK(e.code() == errc::invalid_argument);
    return e.what();
  }
  return {};
}

} // namespace

TEST_CASE("a file written by PyTorch reads back with the same values") {
  auto expected = read_expected();
  REQUIRE(expected.size() == 4);
  safetensors_file file{fixtures + "/dtypes.safetensors"};
  CHECK(file.metadata().at("source") == "torch");
  CHECK(file.tensors().size() == 4);
  for (auto& [name, want] : expected) {
    auto& t = file.at(name);
    CHECK(t.shape == want.shape);
    std::vector<float> got(static_cast<size_t>(t.numel()));
    to_float(t.type, t.data, got.data(), got.size());
    REQUIRE(got.size() == want.values.size());
    for (size_t i = 0; i < got.size(); ++i) {
      CHECK_MESSAGE(got[i] == want.values[i], name << "[" << i << "]");
      CHECK(std::signbit(got[i]) == std::signbit(want.values[i]));
    }
  }
  CHECK(!file.contains("nope"));
  CHECK_THROWS_WITH_AS(file.at("nope"), doctest::Contains("no tensor 'nope'"), error);
}

TEST_CASE("float to half and bfloat16 round like PyTorch") {
  safetensors_file file{fixtures + "/dtypes.safetensors"};
  const float halves[] = {-2.5f, 0.1f, 65504.0f, 1e-7f, -0.0f, 3.14159f};
  auto& b = file.at("b.f16");
  auto stored = reinterpret_cast<const uint16_t*>(b.data);
  for (size_t i = 0; i < 6; ++i)
    CHECK_MESSAGE(float_to_half(halves[i]) == stored[i], "half of " << halves[i]);
  const float bfloats[] = {1.5f, -3.14159f, 1e30f, -1e-30f};
  auto& c = file.at("c.bf16");
  auto stored_bf = reinterpret_cast<const uint16_t*>(c.data);
  for (size_t i = 0; i < 4; ++i)
    CHECK_MESSAGE(float_to_bf16(bfloats[i]) == stored_bf[i], "bfloat16 of " << bfloats[i]);
  CHECK(std::isinf(half_to_float(float_to_half(1e6f))));
  CHECK(std::isnan(half_to_float(float_to_half(NAN))));
  CHECK(std::isnan(bf16_to_float(float_to_bf16(NAN))));
}

TEST_CASE("the writer round-trips every dtype and leaves no file when it cannot write") {
  std::vector<float> a = {1, 2, 3, 4, 5, 6};
  std::vector<uint16_t> h = {float_to_half(0.5f), float_to_half(-7.0f)};
  std::vector<uint16_t> bf = {float_to_bf16(2.0f)};
  safetensors_writer w;
  w.add("a", dtype::f32, {2, 3}, a.data(), a.size() * 4);
  w.add("h", dtype::f16, {2}, h.data(), h.size() * 2);
  w.add("bf", dtype::bf16, {1, 1}, bf.data(), 2);
  w.add_metadata("format", "pt");
  CHECK_THROWS_AS(w.add("a", dtype::f32, {1}, a.data(), 4), error);
  CHECK_THROWS_WITH_AS(w.add("x", dtype::f32, {2}, a.data(), 4), doctest::Contains("'x'"), error);
  auto path = temp_path("roundtrip.safetensors");
  w.write(path);
  CHECK(fs::file_size(path) == w.file_size());
  safetensors_file file{path};
  CHECK(file.at("a").shape == std::vector<int64_t>{2, 3});
  CHECK(std::memcmp(file.at("a").data, a.data(), 24) == 0);
  float back[2];
  to_float(dtype::f16, file.at("h").data, back, 2);
  CHECK(back[1] == -7.0f);
  CHECK(file.metadata().at("format") == "pt");
  fs::remove(path);
  CHECK_THROWS_WITH_AS(w.write("/nonexistent-dir/x.safetensors"),
                       doctest::Contains("/nonexistent-dir/x.safetensors"), error);
  CHECK(!fs::exists("/nonexistent-dir/x.safetensors.partial"));
}

TEST_CASE("broken files are errors naming the file and the tensor") {
  auto path = temp_path("broken.safetensors");
  write_bytes(path, "abc");
  CHECK(error_of(path).find("too short") != std::string::npos);
  write_bytes(path, with_header("{\"a\": 1}", "").substr(0, 12));
  CHECK(error_of(path).find("does not fit") != std::string::npos);
  write_bytes(path, with_header("not json", ""));
  CHECK(error_of(path).find("not a JSON object") != std::string::npos);
  write_bytes(path, with_header(R"({"w":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}})", "x"));
  auto unsupported = error_of(path);
  CHECK(unsupported.find("'w'") != std::string::npos);
  CHECK(unsupported.find("unsupported dtype I8") != std::string::npos);
  CHECK(unsupported.find(path) != std::string::npos);
  write_bytes(path, with_header(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
                                std::string(8, '\0')));
  CHECK(error_of(path).find("outside") != std::string::npos);
  write_bytes(path, with_header(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
                                std::string(8, '\0')));
  CHECK(error_of(path).find("needs 12") != std::string::npos);
  write_bytes(path, with_header(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})",
                                std::string(4, '\0')));
  CHECK(error_of(path).find("impossible dimension") != std::string::npos);
  // A shape whose element count overflows is refused, not wrapped around.
  write_bytes(
    path, with_header(R"({"w":{"dtype":"F32","shape":[4611686018427387905],"data_offsets":[0,4]}})",
                      std::string(4, '\0')));
  CHECK(error_of(path).find("impossible dimension") != std::string::npos);
  write_bytes(path, with_header(R"({"w":{"dtype":"F32"}})", ""));
  CHECK(error_of(path).find("needs dtype, shape and data_offsets") != std::string::npos);
  // A real file cut short.
  std::ifstream in{fixtures + "/dtypes.safetensors", std::ios::binary};
  std::string whole{std::istreambuf_iterator<char>{in}, {}};
  write_bytes(path, whole.substr(0, whole.size() - 5));
  CHECK(error_of(path).find("truncated") != std::string::npos);
  fs::remove(path);
  CHECK(error_of("/nonexistent/model.safetensors").find("/nonexistent/model.safetensors") !=
        std::string::npos);
}
