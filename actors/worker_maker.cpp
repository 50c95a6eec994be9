#include "actors/worker_maker.hpp"

#include "actors/worker_actor.hpp"
#include "troupe/errors.hpp"

#include <caf/all.hpp>

#include <mutex>

namespace troupe {

worker_maker::worker_maker(const executor_config& cfg, worker_factory factory,
                           caf::actor lease_holder, std::shared_ptr<replacement_list> replacements,
                           std::vector<worker_place>& places)
  : factory_(std::move(factory)),
    leases_(std::make_unique<replacement_leases>(cfg, std::move(lease_holder))),
    replacements_(std::move(replacements)), places_(places) {}

std::string worker_maker::refusal(int32_t rank, bool local) const {
  if (local && !factory_)
    return "no worker factory to make a worker of this process";
  if (!local && places_[static_cast<size_t>(rank)].kind != "node" && !factory_)
    return "a worker published on its own is replaced by one of this process, and there "
           "is no worker factory to make it";
  return {};
}

void worker_maker::make(supervisor_actor::pointer self, int32_t rank, std::function<bool()> wanted,
                        std::function<void(worker_actor)> made,
                        std::function<void(caf::error)> failed) {
  auto& place = places_[static_cast<size_t>(rank)];
  if (place.kind == "node") {
    auto* places = &places_;
    auto replacements = replacements_;
    leases_->lease(
      self, {place.host, place.port, 1},
      [places, replacements, rank, wanted, made](worker_actor& fresh, const node_address& n,
                                                 std::shared_ptr<link_client> link) {
        if (!wanted())
          return; // the lease ends with the holder
        (*places)[static_cast<size_t>(rank)] = {"node", n.host, n.port, std::move(link)};
        {
          std::lock_guard<std::mutex> lk{replacements->mtx};
          replacements->leased.push_back(fresh);
        }
        made(fresh);
      },
      [wanted, failed](caf::error& err) {
        if (wanted())
          failed(std::move(err));
      });
    return;
  }
  place = worker_place{};
  worker_actor fresh;
  try {
    fresh = spawn_worker(self->system(), factory_);
  } catch (const std::exception& e) {
    failed(caf::make_error(errc::worker_died, std::string{"cannot spawn: "} + e.what()));
    return;
  }
  {
    std::lock_guard<std::mutex> lk{replacements_->mtx};
    replacements_->workers.push_back(fresh);
  }
  made(fresh);
}

void worker_maker::stop() {
  leases_.reset();
}

} // namespace troupe
