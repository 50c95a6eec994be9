// The executor's sleep/wake state machine on its own.

#include "actors/sleep_state.hpp"

#include <doctest/doctest.h>

using namespace troupe;

TEST_CASE("sleep then wake everything returns to awake") {
  sleep_state s;
  CHECK(!s.is_sleeping());
  auto d = s.check_sleep();
  REQUIRE(d.proceed);
  s.commit_sleep(sleep_level::offload_weights);
  CHECK(s.is_sleeping());
  CHECK(std::holds_alternative<sleep_state::asleep>(s.current()));
  CHECK(s.level() == 1);
  CHECK(s.sleeping_tags() == std::vector<memory_tag>{memory_tag::weights, memory_tag::kv_cache});
  auto w = s.check_wake({});
  REQUIRE(w.proceed);
  CHECK(w.tags == std::vector<memory_tag>{memory_tag::weights, memory_tag::kv_cache});
  s.commit_wake(w.tags);
  CHECK(std::holds_alternative<sleep_state::awake>(s.current()));
}

TEST_CASE("waking one tag leaves the executor partly awake") {
  sleep_state s;
  s.commit_sleep(sleep_level::discard);
  auto w = s.check_wake({"weights"});
  REQUIRE(w.proceed);
  s.commit_wake(w.tags);
  CHECK(s.is_sleeping());
  CHECK(std::holds_alternative<sleep_state::partly_awake>(s.current()));
  CHECK(s.level() == 2);
  CHECK(s.sleeping_tags() == std::vector<memory_tag>{memory_tag::kv_cache});
  // The woken tag is no longer asleep: waking it again is refused.
  auto again = s.check_wake({"weights"});
  CHECK(!again.proceed);
  CHECK(again.warning.find("not in sleeping tags {kv_cache}") != std::string::npos);
  auto rest = s.check_wake({"kv_cache"});
  REQUIRE(rest.proceed);
  s.commit_wake(rest.tags);
  CHECK(!s.is_sleeping());
}

TEST_CASE("sleeping twice waking when awake and unknown tags are refused with a warning") {
  sleep_state s;
  auto wake_awake = s.check_wake({});
  CHECK(!wake_awake.proceed);
  CHECK(wake_awake.warning.find("not sleeping") != std::string::npos);
  s.commit_sleep(sleep_level::offload_weights);
  auto twice = s.check_sleep();
  CHECK(!twice.proceed);
  CHECK(twice.warning.find("already sleeping") != std::string::npos);
  auto unknown = s.check_wake({"activations"});
  CHECK(!unknown.proceed);
  CHECK(unknown.warning.find("activations") != std::string::npos);
  // A refused transition changes nothing.
  CHECK(std::holds_alternative<sleep_state::asleep>(s.current()));
  CHECK(s.sleeping_tags().size() == 2);
}

TEST_CASE("describe prints a tag set like vLLM") {
  CHECK(describe({memory_tag::weights, memory_tag::kv_cache}) == "{weights, kv_cache}");
  CHECK(describe({}) == "{}");
}
