// The wire vocabulary: every type survives a binary round trip, and every type crosses
// between two actor systems over loopback (the only way to catch a missing registration).

#include "messages/protocols.hpp"

#include "troupe/errors.hpp"

#include <caf/all.hpp>
#include <caf/io/all.hpp>
#include <doctest/doctest.h>

#include <vector>

using namespace troupe;

namespace {

execute_model_request sample_request() {
  execute_model_request req;
  sequence_group_metadata g;
  g.request_id = "req-1";
  g.is_prompt = true;
  g.seqs.push_back({7, {1, 2, 3, 4}, 3, 0, {5, 9}});
  g.sampling.temperature = 0.7f;
  g.sampling.top_p = 0.9f;
  g.sampling.top_k = 40;
  g.sampling.seed = 1234;
  g.sampling.stop_token_ids = {2};
  g.token_chunk_size = 4;
  g.lora_int_id = 3;
  g.prompt_adapter_id = 2;
  req.seq_group_metadata_list.push_back(g);
  req.blocks_to_swap_in = {{1, 2}};
  req.blocks_to_swap_out = {{3, 4}};
  req.blocks_to_copy = {{5, 6}, {7, 8}};
  req.num_lookahead_slots = 1;
  req.running_queue_size = 2;
  req.finished_requests_ids = {"old"};
  return req;
}

sampler_output sample_output() {
  sampler_output out;
  out.outputs.push_back({"req-1", {{7, 42, -0.25f, 3, {{42, -0.25f}, {7, -2.5f}}}}});
  return out;
}

worker_health sample_health() {
  worker_health h;
  h.rank = 1;
  h.healthy = false;
  h.detail = "tired";
  h.memory = {{memory_tag::kv_cache, 100, 50, 10}};
  h.sleeping_tags = {memory_tag::weights};
  return h;
}

/// One value of every type in the type-id block.
std::vector<caf::message> every_type() {
  return {
    caf::make_message(memory_tag::kv_cache),
    caf::make_message(sample_request().seq_group_metadata_list[0].sampling),
    caf::make_message(sample_request().seq_group_metadata_list[0].seqs[0]),
    caf::make_message(sample_request().seq_group_metadata_list[0]),
    caf::make_message(block_move{3, 4}),
    caf::make_message(sample_request()),
    caf::make_message(token_logprob{5, -1.5f}),
    caf::make_message(sample_output().outputs[0].samples[0]),
    caf::make_message(sample_output().outputs[0]),
    caf::make_message(sample_output()),
    caf::make_message(lora_request{"sql", 3, "/adapters/sql"}),
    caf::make_message(prompt_adapter_request{"pa", 2, "/adapters/pa", 8}),
    caf::make_message(cache_blocks{1000, 64}),
    caf::make_message(sleep_request{sleep_level::discard}),
    caf::make_message(wake_request{{memory_tag::weights, memory_tag::kv_cache}}),
    caf::make_message(sharded_state_request{"/tmp/x", "p-{rank}-{part}", 1 << 20}),
    caf::make_message(memory_usage{memory_tag::weights, 10, 5, 1}),
    caf::make_message(worker_info{1, 2, "cpu:1", "host", 42}),
    caf::make_message(sample_health()),
    caf::make_message(worker_context{1, 2, device_kind::cuda, 1, 16, 2048, "/tmp", "127.0.0.1"}),
    caf::make_message(std::vector<sampler_output>{sample_output(), sample_output()}),
    caf::make_message(std::vector<memory_tag>{memory_tag::kv_cache}),
    caf::make_message(std::vector<worker_health>{sample_health()}),
    caf::make_message(std::vector<int64_t>{1, 2, 3}),
    caf::make_message(std::vector<int32_t>{4, 5}),
    caf::make_message(rpc_options{1500, 2}),
    caf::make_message(std::vector<std::vector<std::string>>{{"", "addr"}, {"x", ""}}),
    // The library's calls (messages/worker_calls.hpp).
    caf::make_message(call_atom::value, blocks_query{}),
    caf::make_message(call_atom::value, cache_init{{1000, 64}}),
    caf::make_message(call_atom::value, health_query{}),
    caf::make_message(call_atom::value, collective_prepare{}),
    caf::make_message(call_atom::value, collective_connect{{{"a", "b"}, {""}}}),
    caf::make_message(call_atom::value, staged_save{{"/tmp/x", "p", 7}, "token"}),
    caf::make_message(call_atom::value, staged_finish{"/tmp/x", "token", true}),
    caf::make_message(call_atom::value,
                      to_adapter_request(prompt_adapter_request{"pa", 2, "/adapters/pa", 8})),
    caf::make_message(call_atom::value,
                      adapter_change{adapter_kind::prompt_adapter, adapter_action::pin, 2}),
    caf::make_message(call_atom::value, adapter_list{adapter_kind::lora}),
    caf::make_message(agree_atom::value, adapter_tokens{9}),
    // The shapes of the worker protocol.
    caf::make_message(init_atom::value, worker_context{}, worker_handles{{worker_actor{}}}),
    caf::make_message(peers_atom::value, worker_handles{}),
    caf::make_message(caf::ok_atom::value, worker_info{}),
    caf::make_message(caf::ok_atom::value, int64_t{42}),
    caf::make_message(call_atom::value, std::string{"execute_model"},
                      caf::make_message(sample_request()), caf::settings{}),
    caf::make_message(caf::ok_atom::value, caf::make_message(std::vector<int64_t>{1})),
    caf::make_message(execute_atom::value, stop_loop_atom::value, int64_t{3}),
    caf::make_message(step_atom::value, stop_loop_atom::value, int64_t{3}),
    caf::make_message(step_atom::value, sample_request()),
  };
}

caf::actor_system_config& with_messages(caf::actor_system_config& cfg) {
  register_messages(cfg);
  return cfg;
}

} // namespace

TEST_CASE("the type-id block covers every type of the vocabulary") {
  using block = caf::id_block::troupe;
  CHECK(block::end - block::begin == 39);
}

TEST_CASE("every message type survives a binary round trip") {
  caf::actor_system_config cfg;
  caf::actor_system sys{with_messages(cfg)};
  for (auto& msg : every_type()) {
    std::vector<char> buf;
    caf::binary_serializer sink{sys, buf};
    auto copy = msg;
    REQUIRE_MESSAGE(!sink(copy), "cannot serialise " << to_string(msg));
    caf::message restored;
    caf::binary_deserializer source{sys, buf};
    REQUIRE_MESSAGE(!source(restored), "cannot deserialise " << to_string(msg));
    CHECK_MESSAGE(to_string(restored) == to_string(msg), "round trip changed " << to_string(msg));
  }
}

TEST_CASE("every message type crosses between two actor systems over loopback") {
  caf::actor_system_config server_cfg;
  with_messages(server_cfg).load<caf::io::middleman>();
  caf::actor_system server{server_cfg};
  // Echoes whatever arrives; a type the receiving side cannot deserialise never gets here.
  auto echo = server.spawn([](caf::event_based_actor* self) -> caf::behavior {
    self->set_default_handler(caf::reflect);
    return {[](init_atom) {}};
  });
  auto port = server.middleman().publish(echo, 0, "127.0.0.1");
  REQUIRE(port);

  caf::actor_system_config client_cfg;
  with_messages(client_cfg).load<caf::io::middleman>();
  caf::actor_system client{client_cfg};
  auto remote = client.middleman().remote_actor("127.0.0.1", *port);
  REQUIRE(remote);
  caf::scoped_actor self{client};
  for (auto& msg : every_type()) {
    // Nested in a message, as worker replies carry their results.
    bool answered = false;
    self->request(*remote, std::chrono::seconds(5), caf::ok_atom::value, msg)
      .receive(
        [&](caf::ok_atom, caf::message& reply) {
          answered = true;
          CHECK(to_string(reply) == to_string(msg));
        },
        [&](caf::error& err) { FAIL("no echo for " << to_string(msg) << ": " << render(err)); });
    CHECK(answered);
  }
  caf::anon_send_exit(echo, caf::exit_reason::user_shutdown);
}

TEST_CASE("troupe errors render by name with their context") {
  auto err = caf::make_error(errc::worker_died, std::string{"rank 1 went down"});
  CHECK(render(err) == "worker_died: rank 1 went down");
  CHECK(to_errc(err) == errc::worker_died);
  CHECK(to_errc(caf::make_error(caf::sec::request_timeout)) == errc::timeout);
  auto ex = error::from(err);
  CHECK(ex.code() == errc::worker_died);
  CHECK(std::string{ex.what()}.find("rank 1") != std::string::npos);
}
