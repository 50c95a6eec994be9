#include "actors/worker_group.hpp"

#include "troupe/errors.hpp"

namespace troupe {

worker_group::worker_group(gather_table& gathers, group_host& host, const executor_config& cfg,
                           std::vector<int32_t> ranks)
  : gathers_(gathers), host_(host), cfg_(cfg), ranks_(std::move(ranks)) {}

ask_fn worker_group::init_request(int32_t rank) const {
  return asking(init_atom::value, contexts_[static_cast<size_t>(rank)],
                rank == 0 ? host_.driver_peers() : worker_handles{});
}

void worker_group::start(std::function<void(caf::expected<std::vector<worker_info>>)> done) {
  auto world = static_cast<int32_t>(ranks_.size());
  int32_t local_index = 0;
  contexts_.clear();
  for (int32_t rank = 0; rank < world; ++rank) {
    worker_context ctx;
    ctx.rank = rank;
    ctx.world_size = world;
    ctx.device_type = cfg_.device_type;
    ctx.device_index = host_.in_process(static_cast<size_t>(rank)) ? local_index++ : 0;
    ctx.block_size = cfg_.block_size;
    ctx.max_model_len = cfg_.max_model_len;
    ctx.profile_dir = cfg_.profile_dir;
    ctx.collective_host = cfg_.collective_host;
    ctx.linger_us = cfg_.linger.count();
    contexts_.push_back(ctx);
  }
  std::vector<ask_fn> requests;
  for (int32_t rank = 0; rank < world; ++rank)
    requests.push_back(init_request(rank));
  gathers_.start(
    "init", ranks_, nullptr, cfg_.startup_timeout, 0,
    [this, done](gather_result res) {
      if (!res)
        return done(res.error());
      std::vector<worker_info> infos;
      for (size_t rank = 0; rank < res->size(); ++rank) {
        auto& info = (*res)[rank];
        if (!info.match_elements<worker_info>())
          return done(caf::make_error(errc::bad_arguments,
                                      "rank " + std::to_string(rank) + " answered init with (" +
                                        to_string(info) + "), not a worker_info"));
        infos.push_back(info.get_as<worker_info>(0));
      }
      if (auto err = different_models(infos))
        return done(std::move(err));
      form([done, infos](caf::error err) {
        if (err)
          done(std::move(err));
        else
          done(infos);
      });
    },
    std::move(requests));
}

void worker_group::form(std::function<void(caf::error)> then) {
  if (ranks_.size() < 2)
    return then(caf::none);
  gathers_.start("group", ranks_, asking(group_atom::value, host_.members()), cfg_.startup_timeout,
                 0, [this, then](gather_result res) {
                   if (!res)
                     return then(res.error());
                   connect(then);
                 });
}

void worker_group::connect(std::function<void(caf::error)> then) {
  const auto prepare = method_name(collective_prepare{});
  gathers_.start(
    prepare, ranks_, typed_call(collective_prepare{}), cfg_.startup_timeout, 0,
    [this, then, prepare](gather_result res) {
      if (!res)
        return then(res.error());
      collective_connect call;
      bool needed = false;
      try {
        for (size_t rank = 0; rank < res->size(); ++rank) {
          call.table.push_back(result_as<std::vector<std::string>>((*res)[rank], rank, prepare));
          needed = needed || !call.table.back().empty();
        }
      } catch (const error& e) {
        return then(caf::make_error(e.code(), std::string{e.what()}));
      }
      if (!needed)
        return then(caf::none);
      gathers_.start(method_name(call), ranks_, typed_call(std::move(call)), cfg_.startup_timeout,
                     0, [then](gather_result done) { then(done ? caf::none : done.error()); });
    });
}

caf::error worker_group::different_models(const std::vector<worker_info>& infos) const {
  if (infos.empty())
    return {};
  auto& first = infos.front();
  for (auto& info : infos) {
    if (first.model_fingerprint.empty() || info.model_fingerprint.empty() ||
        info.model_fingerprint == first.model_fingerprint)
      continue;
    return caf::make_error(errc::inconsistent_workers,
                           host_.where(first) + " and " + host_.where(info) +
                             " loaded different models from '" + first.model + "' and '" +
                             info.model +
                             "': their configs or files differ (names, shapes, types or bytes "
                             "of the tensors); every host needs the same files");
  }
  return {};
}

} // namespace troupe
