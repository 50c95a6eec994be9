#include "actors/sharded_save.hpp"

#include "troupe/errors.hpp"

namespace troupe {

void save_sharded(gather_table& gathers, recovery& recov, std::vector<int32_t> ranks,
                  timeout_type timeout, std::shared_ptr<spdlog::logger> log,
                  sharded_state_request req, std::string token,
                  std::function<void(caf::error)> done) {
  auto finish = [req, token](bool commit) {
    return typed_call(staged_finish{req.path, token, commit});
  };
  auto* table = &gathers;
  auto* rec = &recov;
  auto clean_up = [table, rec, ranks, timeout, log, finish](std::function<void()> then) {
    auto one_done = after_calls(ranks.size(), std::move(then));
    for (auto rank : ranks)
      table->start("save_sharded_state", {rank}, finish(false), timeout, 0,
                   [rec, rank, log, finish, one_done](gather_result res) {
                     if (res)
                       return one_done();
                     rec->leave(rank, "save_sharded_state", finish(false));
                     if (!rec->under_way() || rec->rank() != rank) {
                       log->warn("rank {} did not remove its part of a failed save ({}): its "
                                 "next replacement will",
                                 rank, render(res.error()));
                       return one_done();
                     }
                     rec->after([rec, rank, one_done](caf::error failed) {
                       if (failed)
                         return one_done();
                       rec->make_leftover_calls(rank, one_done);
                     });
                   });
  };
  gathers.start("save_sharded_state", ranks, typed_call(staged_save{req, token}), timeout, 0,
                [=](gather_result res) {
                  if (!res) {
                    auto failure = res.error();
                    clean_up([done, failure] { done(failure); });
                    return;
                  }
                  table->start("save_sharded_state", ranks, finish(true), timeout, 0,
                               [done](gather_result committed) {
                                 done(committed ? caf::error{} : committed.error());
                               });
                });
}

} // namespace troupe
