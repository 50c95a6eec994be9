#include "actors/gather_table.hpp"

#include "messages/messages.hpp"
#include "troupe/errors.hpp"

#include <caf/all.hpp>

#include <algorithm>
#include <cstdio>

namespace troupe {

namespace {

/// How long a call that a worker's death failed waits for that death to be reported.
constexpr auto settle_time = std::chrono::seconds(1);

/// Maps the error of one request to the error of the whole call, naming the rank.
caf::error rank_error(const gather& g, int32_t rank, const caf::error& err) {
  if (err == caf::sec::request_timeout)
    return caf::make_error(errc::timeout, g.label + ": rank " + std::to_string(rank) +
                                            " did not answer within " + ms_text(g.timeout));
  if (err == caf::sec::request_receiver_down) {
    // A call link that closed under the request says why.
    auto& how = err.context();
    return caf::make_error(errc::worker_died, g.label + ": rank " + std::to_string(rank) +
                                                " is down" +
                                                (how.match_elements<std::string>()
                                                   ? " (" + how.get_as<std::string>(0) + ")"
                                                   : std::string{}));
  }
  if (err.category() == caf::atom("troupe"))
    return err; // The worker already named its rank.
  return caf::make_error(errc::worker_error,
                         g.label + ": rank " + std::to_string(rank) + ": " + render(err));
}

/// The first rank of `g` that has not replied: the one a missed deadline is blamed on.
int32_t first_silent_rank(const gather& g) {
  for (size_t i = 0; i < g.ranks.size(); ++i)
    if (g.direct ? !g.direct->answered(i) : !g.answered[i])
      return g.ranks[i];
  return g.ranks.front();
}

/// Whether the table has `g` to finish: always, unless it is a direct gather that its last
/// worker finished already. A claimed gather is the table's for good.
bool claim(gather& g) {
  if (g.direct && !g.claimed)
    g.claimed = g.direct->take();
  return !g.direct || g.claimed;
}

} // namespace

ask_fn calling(std::string method, caf::message args, caf::settings kwargs) {
  return asking(call_atom::value, std::move(method), std::move(args), std::move(kwargs));
}

std::string ms_text(timeout_type t) {
  auto ms = std::chrono::duration<double, std::milli>(t).count();
  auto whole = static_cast<int64_t>(ms);
  if (static_cast<double>(whole) == ms)
    return std::to_string(whole) + " ms";
  char text[64];
  std::snprintf(text, sizeof text, "%.3f ms", ms);
  return text;
}

gather_ptr gather_table::start(std::string label, std::vector<int32_t> ranks, ask_fn ask,
                               timeout_type timeout, size_t max_concurrent,
                               std::function<void(gather_result)> done,
                               std::vector<ask_fn> per_rank) {
  return launch(std::move(label), std::move(ranks), std::move(ask), timeout, max_concurrent,
                std::move(done), std::move(per_rank), {});
}

gather_ptr gather_table::start_direct(std::string label, std::vector<int32_t> ranks,
                                      caf::message request, timeout_type timeout,
                                      std::function<void(gather_result)> done) {
  return launch(std::move(label), std::move(ranks), nullptr, timeout, 0, std::move(done), {},
                std::move(request));
}

gather_ptr gather_table::launch(std::string label, std::vector<int32_t> ranks, ask_fn ask,
                                timeout_type timeout, size_t max_concurrent,
                                std::function<void(gather_result)> done,
                                std::vector<ask_fn> per_rank, caf::message request) {
  sweep();
  auto g = std::make_shared<gather>();
  g->id = next_id_++;
  g->label = std::move(label);
  g->ranks = std::move(ranks);
  g->ask = std::move(ask);
  g->per_rank = std::move(per_rank);
  g->timeout = timeout;
  g->forever = timeout == wait_forever;
  if (!g->forever)
    g->deadline = clock_type::now() + timeout;
  g->max_concurrent = max_concurrent;
  g->remaining = g->ranks.size();
  if (request.empty()) {
    g->results.resize(g->ranks.size());
    g->answered.resize(g->ranks.size());
    g->done = std::move(done);
  } else {
    g->request = std::move(request);
    g->direct = std::make_shared<direct_reply>(g->id, g->ranks.size(), std::move(done));
  }
  if (auto why = host_.refusal(*g)) {
    g->finished = true;
    conclude(*g, std::move(why));
    return g;
  }
  if (g->ranks.empty()) {
    g->finished = true;
    conclude(*g, std::vector<caf::message>{});
    return g;
  }
  pending_.emplace(g->id, g);
  if (!g->forever)
    arm_deadline(g->deadline);
  send_next(g);
  return g;
}

void gather_table::send_next(const gather_ptr& g) {
  if (g->direct) {
    // The last rank gets the gather's own copy: a worker that finds the message unshared
    // takes its contents instead of copying them (a step's request, every step).
    for (size_t index = 0; index < g->ranks.size(); ++index) {
      auto rank = static_cast<size_t>(g->ranks[index]);
      sink_.ask(g->direct, index, caf::actor_cast<caf::actor>(host_.target(rank)),
                index + 1 < g->ranks.size() ? g->request : std::move(g->request), self_->context());
    }
    return;
  }
  while (!g->finished && g->next < g->ranks.size() &&
         (g->max_concurrent == 0 || g->in_flight < g->max_concurrent)) {
    auto index = g->next++;
    ++g->in_flight;
    auto& ask = g->per_rank.empty() ? g->ask : g->per_rank[index];
    auto* table = this;
    ask(
      self_, host_.target(static_cast<size_t>(g->ranks[index])),
      [table, g, index](caf::ok_atom, caf::message& result) {
        if (g->finished)
          return;
        --g->in_flight;
        g->answered[index] = true;
        g->results[index] = std::move(result);
        if (--g->remaining == 0)
          table->finish(g, std::move(g->results));
        else
          table->send_next(g);
      },
      [table, g, index](caf::error& err) { table->rank_failed(g, index, err); });
  }
}

void gather_table::rank_failed(const gather_ptr& g, size_t index, const caf::error& err) {
  auto why = rank_error(*g, g->ranks[index], err);
  if (host_.replaces_workers() && to_errc(why) == errc::worker_died)
    hold(g, std::move(why));
  else
    finish(g, std::move(why));
}

void gather_table::direct_failed(uint64_t id, uint64_t index, const caf::error& err) {
  auto i = pending_.find(id);
  if (i == pending_.end() || i->second->direct->taken())
    return;
  auto g = i->second;
  rank_failed(g, static_cast<size_t>(index), err);
}

void gather_table::conclude(gather& g, gather_result result) {
  if (!g.direct) {
    g.done(std::move(result));
    return;
  }
  sink_.forget(*g.direct);
  if (claim(g))
    g.direct->done(std::move(result));
}

void gather_table::sweep() {
  for (auto i = pending_.begin(); i != pending_.end();) {
    auto& g = *i->second;
    if (g.direct && !g.claimed && g.direct->taken()) { // every reply came: no key is left
      g.finished = true;
      i = pending_.erase(i);
    } else {
      ++i;
    }
  }
}

void gather_table::hold(const gather_ptr& g, caf::error why) {
  if (g->finished || g->held)
    return;
  if (auto lost = host_.work_lost()) { // the death is known: the worker is being replaced
    finish(g, std::move(lost));
    return;
  }
  g->held = std::move(why);
  g->settle_at = clock_type::now() + settle_time;
  arm_deadline(g->settle_at);
}

void gather_table::finish(const gather_ptr& g, gather_result result) {
  if (g->finished)
    return;
  g->finished = true;
  pending_.erase(g->id);
  conclude(*g, std::move(result));
}

void gather_table::fail_all(const caf::error& why) {
  auto calls = std::move(pending_);
  pending_.clear();
  for (auto& [id, g] : calls) {
    g->finished = true;
    conclude(*g, why);
  }
}

bool gather_table::claim_any(const std::string& label) {
  bool any = false;
  for (auto& entry : pending_)
    if (entry.second->label == label && claim(*entry.second))
      any = true;
  return any;
}

void gather_table::arm_deadline(clock_type::time_point at) {
  if (timer_armed_ && timer_at_ <= at)
    return;
  timer_armed_ = true;
  timer_at_ = at;
  auto in = std::max(at - clock_type::now(), clock_type::duration::zero());
  self_->delayed_send(self_, in, deadline_atom::value,
                      static_cast<int64_t>(at.time_since_epoch().count()));
}

void gather_table::check_deadlines(int64_t at) {
  if (timer_armed_ && timer_at_.time_since_epoch().count() == at)
    timer_armed_ = false;
  sweep();
  auto now = clock_type::now();
  std::vector<gather_ptr> expired;
  std::vector<gather_ptr> settled;
  for (auto& entry : pending_) {
    auto& g = entry.second;
    if (g->held && g->settle_at <= now)
      settled.push_back(g);
    else if (!g->forever && g->deadline <= now)
      expired.push_back(g);
  }
  for (auto& g : settled)
    finish(g, g->held);
  for (auto& g : expired)
    finish(g, rank_error(*g, first_silent_rank(*g), caf::sec::request_timeout));
  for (auto& entry : pending_) {
    if (entry.second->held)
      arm_deadline(entry.second->settle_at);
    if (!entry.second->forever)
      arm_deadline(entry.second->deadline);
  }
}

} // namespace troupe
