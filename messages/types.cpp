#include "troupe/types.hpp"

#include "troupe/errors.hpp"

namespace troupe {

sleep_level to_sleep_level(int64_t level) {
  if (level != 1 && level != 2)
    throw error{errc::invalid_argument, "sleep level must be 1 or 2, got " + std::to_string(level)};
  return static_cast<sleep_level>(level);
}

const char* to_string(memory_tag tag) {
  switch (tag) {
    case memory_tag::weights:
      return "weights";
    case memory_tag::kv_cache:
      return "kv_cache";
  }
  return "unknown";
}

std::optional<memory_tag> parse_memory_tag(std::string_view name) {
  for (auto tag : all_memory_tags)
    if (name == to_string(tag))
      return tag;
  return std::nullopt;
}

std::vector<int32_t> step_positions(const sequence_data& seq, int32_t token_chunk_size) {
  std::vector<int32_t> positions(static_cast<size_t>(std::max(token_chunk_size, 0)));
  for (size_t i = 0; i < positions.size(); ++i)
    positions[i] = seq.num_computed_tokens + static_cast<int32_t>(i);
  return positions;
}

} // namespace troupe
