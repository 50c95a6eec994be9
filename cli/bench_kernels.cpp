// `troupe bench kernels`: the CPU kernels a decode step spends its time in, one thread, at a
// model's shapes, next to a plain read of the same bytes: attention over a paged cache (the
// heads of a GQA group together, as the backend runs them, against one head at a time and
// against a cache whose slots hold every head's row together), and the 16-bit row product
// at batch 1.

#include "cli/commands.hpp"

#include "kernels/cpu/quant.hpp"
#include "kernels/dtype.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <numeric>
#include <random>
#include <vector>

namespace troupe::cli {

namespace {

using clock_type = std::chrono::steady_clock;

/// The best of `rounds` timings of `f`, in seconds.
template <class F>
double best_of(int rounds, F&& f) {
  double best = 1e30;
  for (int i = 0; i < rounds; ++i) {
    auto start = clock_type::now();
    f();
    best = std::min(best, std::chrono::duration<double>(clock_type::now() - start).count());
  }
  return best;
}

/// Seconds one thread takes to read `data` (the read floor).
double read_seconds(const std::vector<float>& data, int rounds) {
  auto bytes = data.size() * sizeof(float);
  return static_cast<double>(bytes) / cpu_read_bandwidth(data.data(), bytes, 1, rounds);
}

} // namespace

std::shared_ptr<command> add_bench_kernels(CLI::App& bench) {
  struct options {
    int64_t positions = 600;
    int64_t layers = 16;
    int64_t heads = 32;
    int64_t kv_heads = 8;
    int64_t head_dim = 64;
    int64_t block_size = 16;
    int64_t rows = 49152;
    int64_t cols = 576;
    int rounds = 10;
    bool json = false;
  };
  auto o = std::make_shared<options>();
  auto cmd = std::make_shared<command>();
  auto* sub = bench.add_subcommand(
    "kernels", "CPU attention and 16-bit row products at a model's shapes, one thread");
  cmd->app = sub;
  sub->add_option("--positions", o->positions, "Cached positions attended to")
    ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
    ->capture_default_str();
  sub->add_option("--layers", o->layers, "Layers (each its own cache)")
    ->check(CLI::Range(1, 1024))
    ->capture_default_str();
  sub->add_option("--heads", o->heads, "Query heads")
    ->check(CLI::Range(1, 1024))
    ->capture_default_str();
  sub->add_option("--kv-heads", o->kv_heads, "Key-value heads (dividing --heads)")
    ->check(CLI::Range(1, 1024))
    ->capture_default_str();
  sub->add_option("--head-dim", o->head_dim, "Head size")
    ->check(CLI::Range(1, 1024))
    ->capture_default_str();
  sub->add_option("--block-size", o->block_size, "Slots of a cache block")
    ->check(CLI::Range(1, 1024))
    ->capture_default_str();
  sub->add_option("--rows", o->rows, "Rows of the F16 matrix")
    ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
    ->capture_default_str();
  sub->add_option("--cols", o->cols, "Columns of the F16 matrix")
    ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
    ->capture_default_str();
  sub->add_option("--rounds", o->rounds, "Timings of each, the best kept")
    ->check(CLI::Range(1, 1000))
    ->capture_default_str();
  sub->add_flag("--json", o->json, "Print only the JSON result");
  cmd->run = [o] {
    if (o->heads % o->kv_heads != 0)
      throw CLI::ValidationError("--kv-heads", "must divide --heads");
    const auto isa = cpu::best_isa();
    const auto group = o->heads / o->kv_heads;
    const auto row = o->kv_heads * o->head_dim;
    const auto blocks = (o->positions + o->block_size - 1) / o->block_size;
    const auto layer_floats = blocks * o->block_size * row;
    std::mt19937 rng{7};
    std::uniform_real_distribution<float> uniform{-1.0f, 1.0f};
    auto random = [&](size_t n) {
      std::vector<float> v(n);
      for (auto& x : v)
        x = uniform(rng);
      return v;
    };
    auto keys = random(static_cast<size_t>(o->layers * layer_floats));
    auto values = random(keys.size());
    auto query = random(static_cast<size_t>(o->heads * o->head_dim));
    std::vector<float> out(query.size()), alone(query.size());
    std::vector<float> scores(static_cast<size_t>(group * o->positions));
    std::vector<int64_t> offsets(static_cast<size_t>(o->positions));
    // The cache's blocks in a shuffled order, as a block table has them.
    std::vector<int64_t> table(static_cast<size_t>(blocks));
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    // Where position p of kv head h lies: the backend's layout (each head's slots of a block
    // together), or every head's row of a slot together.
    auto place = [&](bool head_major, int64_t layer, int64_t h) {
      for (int64_t p = 0; p < o->positions; ++p) {
        auto block = table[static_cast<size_t>(p / o->block_size)];
        auto slot = p % o->block_size;
        offsets[static_cast<size_t>(p)] =
          layer * layer_floats + block * o->block_size * row +
          (head_major ? h * o->block_size * o->head_dim + slot * o->head_dim
                      : slot * row + h * o->head_dim);
      }
    };
    auto step = [&](bool head_major, bool grouped, std::vector<float>& result) {
      for (int64_t layer = 0; layer < o->layers; ++layer)
        for (int64_t h = 0; h < o->kv_heads; ++h) {
          place(head_major, layer, h);
          for (int64_t g = 0; g < group; g += grouped ? group : 1) {
            auto at = (h * group + g) * o->head_dim;
            cpu::attend(isa, query.data() + at, o->head_dim, grouped ? group : 1, o->positions,
                        0.125f, keys.data(), values.data(), offsets.data(), scores.data(),
                        result.data() + at);
          }
        }
    };
    double grouped = best_of(o->rounds, [&] { step(true, true, out); });
    double one_head = best_of(o->rounds, [&] { step(true, false, alone); });
    bool same = out == alone;
    double slot_major = best_of(o->rounds, [&] { step(false, false, alone); });
    auto kv_bytes = static_cast<double>(2 * o->layers * o->positions * row) * sizeof(float);
    double kv_read = read_seconds(keys, o->rounds) * 2 * o->layers * o->positions * row /
                     static_cast<double>(keys.size());

    // The 16-bit row product at batch 1, from memory.
    std::vector<uint16_t> weights(static_cast<size_t>(o->rows * o->cols));
    {
      auto w = random(weights.size());
      from_float(dtype::f16, w.data(), weights.data(), w.size());
    }
    auto x = random(static_cast<size_t>(o->cols));
    std::vector<float> y(static_cast<size_t>(o->rows));
    double product = best_of(o->rounds, [&] {
      cpu::dot_rows_half(isa, dtype::f16, weights.data(), x.data(), 1, o->cols, y.data(), o->rows,
                         0, o->rows, false);
    });
    std::vector<float> same_bytes(weights.size() / 2);
    double product_read = read_seconds(same_bytes, o->rounds);
    auto weight_bytes = static_cast<double>(weights.size() * sizeof(uint16_t));

    nlohmann::json result = {
      {"isa", cpu::isa_name(isa)},
      {"positions", o->positions},
      {"layers", o->layers},
      {"heads", o->heads},
      {"kv_heads", o->kv_heads},
      {"head_dim", o->head_dim},
      {"attention_ms_per_step", grouped * 1e3},
      {"attention_one_head_at_a_time_ms", one_head * 1e3},
      {"attention_slot_major_one_head_ms", slot_major * 1e3},
      {"kv_read_floor_ms", kv_read * 1e3},
      {"kv_bytes", kv_bytes},
      {"grouped_equals_one_head", same},
      {"f16_rows", o->rows},
      {"f16_cols", o->cols},
      {"f16_product_gb_per_s", weight_bytes / product / 1e9},
      {"read_gb_per_s", weight_bytes / product_read / 1e9},
    };
    if (!o->json)
      std::cout << "attention over " << o->positions << " positions, " << o->layers
                << " layers: " << grouped * 1e3 << " ms (one head at a time " << one_head * 1e3
                << ", slot-major " << slot_major * 1e3 << ", reading the cache once "
                << kv_read * 1e3 << "); F16 " << o->rows << " x " << o->cols << " at "
                << weight_bytes / product / 1e9 << " GB/s (a plain read "
                << weight_bytes / product_read / 1e9 << ")\n";
    std::cout << result.dump() << std::endl;
    return same ? 0 : 1;
  };
  return cmd;
}

} // namespace troupe::cli
