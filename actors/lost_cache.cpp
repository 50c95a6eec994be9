#include "actors/lost_cache.hpp"

#include "troupe/errors.hpp"

namespace troupe {

caf::error lost_cache::refusal(const execute_model_request& req, const std::string& cause) {
  if (untold_) {
    untold_ = false;
    return caf::make_error(errc::worker_replaced,
                           cause + "; it was replaced and the KV cache went with it: compute "
                                   "the requests again");
  }
  if (tables_lost_ && req.keep_block_tables) {
    // A step made before the replacement (sent ahead of the step that learned of it)
    // counts on block tables the ranks kept; the replacement kept none. The first step
    // made after it sends every table whole.
    for (auto& g : req.seq_group_metadata_list)
      for (auto& seq : g.seqs)
        if (seq.first_block != 0)
          return caf::make_error(errc::worker_replaced,
                                 cause + "; a step made before the replacement: compute the "
                                         "requests again");
    tables_lost_ = false;
  }
  return {};
}

} // namespace troupe
