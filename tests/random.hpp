#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace troupe::testing {

/// `n` floats drawn from N(0, scale²) with a fixed seed.
inline std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen{seed};
  std::normal_distribution<float> dist{0.0f, scale};
  std::vector<float> v(n);
  for (auto& x : v)
    x = dist(gen);
  return v;
}

} // namespace troupe::testing
