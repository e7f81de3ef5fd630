// The expert cache's bank as its layer-steps see it (services/worker/expert_cache.py): which slot holds which
// expert (the slot maps, shared with Python), a layer-step's misses read from the expert store into slots
// and the next layer's predicted experts read ahead behind them, all without a call into Python: at one
// token a step, Python's share of a fill (the policy's choice, the maps, the counters, the callback) cost as
// much as reading the records.
//
// Victims: at a step's start the cache gives its policy's state (begin: the free slots and the held ones least
// recently used first; begin_lfu: the free slots and each slot's count of uses and last use), and within the
// step the bank chooses as that policy would: a free slot, else under LRU the least recently used, under LFU
// the fewest uses (ties to the most recent), an expert read ahead counted as the least worth keeping. No victim
// is a slot of the same layer-step, so no slot a layer-step reads is refilled before it runs. Every layer-step
// is logged (take_log) and replayed into the policy in order afterwards (its commit), which brings the policy to
// the state its own choices would have. Without reads (a store read through the page cache), the bank logs the
// layer-steps that found every expert held, and Python fills the others.

#include "kernels.h"

#include <algorithm>
#include <cerrno>
#include <chrono>

namespace {

constexpr int64_t READ_MOST = 256;  // records one read takes at most (expert_cache.READ_MOST)

double seconds_since(std::chrono::steady_clock::time_point began) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
}

}  // namespace

ExpertBank::ExpertBank(DirectReads* reads, int64_t fd, int64_t record, const torch::Tensor& records, std::vector<torch::Tensor> slot_maps)
    : reads_(reads), fd_(fd), record_(record), records_(records), slot_maps_(std::move(slot_maps)) {
  TORCH_CHECK(records.dim() == 2 && records.scalar_type() == torch::kUInt8 && records.size(1) == record && records.is_contiguous(),
              "records must be the bank's contiguous uint8 [slots, record]");
  TORCH_CHECK(!slot_maps_.empty(), "slot_maps: one per MoE layer");
  experts_ = slot_maps_[0].size(0);
  for (const auto& map : slot_maps_) {
    TORCH_CHECK(map.dim() == 1 && map.scalar_type() == torch::kInt32 && map.is_contiguous() && map.size(0) == experts_,
                "every slot map must be contiguous int32 [experts]");
    maps_.push_back(map.data_ptr<int32_t>());
  }
  base_ = records.data_ptr<uint8_t>();
  const int64_t slots = records.size(0);
  key_of_.assign(slots, -1);
  stamp_.assign(slots, 0);
  mark_.assign(slots, 0);
}

ExpertBank::~ExpertBank() {
  for (const auto& read : ahead_) {
    if (read.ticket >= 0) reads_->wait(read.ticket);  // no read may land in a bank its owner has freed
  }
}

void ExpertBank::begin(const std::vector<int64_t>& free, const std::vector<int64_t>& ranked) {
  start(free);
  lfu_ = false;
  queue_.clear();
  for (int64_t slot : ranked) {
    TORCH_CHECK(slot >= 0 && slot < slots(), "begin: slot ", slot, " is not one of the bank's ", slots());
    to_back(slot);
  }
}

void ExpertBank::begin_lfu(const std::vector<int64_t>& free, const torch::Tensor& count, const torch::Tensor& last, int64_t step, int64_t layer,
                           int64_t passes, int64_t aging_passes) {
  TORCH_CHECK(count.numel() == slots() && last.numel() == slots() && count.scalar_type() == torch::kInt64 && last.scalar_type() == torch::kInt64,
              "begin_lfu: count and last must be int64 [slots]");
  TORCH_CHECK(aging_passes >= 1, "aging_passes must be positive");
  start(free);
  lfu_ = true;
  const auto counts = count.contiguous(), lasts = last.contiguous();
  count_.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + slots());
  last_.assign(lasts.data_ptr<int64_t>(), lasts.data_ptr<int64_t>() + slots());
  step_ = step;
  layer_ = layer;
  passes_ = passes;
  aging_passes_ = aging_passes;
}

std::tuple<torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t> ExpertBank::lfu_state() const {
  TORCH_CHECK(lfu_, "lfu_state: the bank was not begun under LFU");
  const auto as_tensor = [](const std::vector<int64_t>& values) {
    return torch::from_blob(const_cast<int64_t*>(values.data()), {static_cast<int64_t>(values.size())}, torch::kInt64).clone();
  };
  return {as_tensor(count_), as_tensor(last_), step_, layer_, passes_};
}

void ExpertBank::start(const std::vector<int64_t>& free) {
  TORCH_CHECK(ahead_.empty(), "begin: reads ahead are still in flight (land them first)");
  for (int64_t slot : free) TORCH_CHECK(slot >= 0 && slot < slots(), "begin: slot ", slot, " is not one of the bank's ", slots());
  free_ = free;
  std::fill(key_of_.begin(), key_of_.end(), -1);
  for (int64_t layer = 0; layer < static_cast<int64_t>(maps_.size()); ++layer) {
    for (int64_t e = 0; e < experts_; ++e) {
      if (const int32_t slot = maps_[layer][e]; slot >= 0) key_of_[slot] = layer * experts_ + e;
    }
  }
}

ExpertBank::LayerStep& ExpertBank::ran(int64_t layer, const std::vector<int64_t>& experts) {
  ++epoch_;
  next_step(layer);
  for (int64_t e : experts) {
    const int32_t slot = maps_.at(layer)[e];
    TORCH_CHECK(slot >= 0, "layer ", layer, "'s expert ", e, " ran from the bank, but no slot holds it");
    used(slot);
  }
  auto& step = log_.emplace_back();
  step.layer = layer;
  step.experts = experts;
  return step;
}

ExpertBank::LayerStep& ExpertBank::fill(int64_t layer, const std::vector<int64_t>& experts, int64_t ahead_layer, const std::vector<int64_t>& ahead) {
  TORCH_CHECK(reads_ != nullptr, "this bank has no reads: Python fills it");
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(maps_.size()), "no MoE layer ", layer);
  TORCH_CHECK(static_cast<int64_t>(experts.size()) <= slots(), "a layer-step of ", experts.size(), " experts does not fit ", slots(), " slots");
  TORCH_CHECK(ahead_layer < static_cast<int64_t>(maps_.size()), "no MoE layer ", ahead_layer, " to read ahead");
  const auto began = std::chrono::steady_clock::now();
  auto step = land(layer, experts);
  step.layer = layer;
  step.experts = experts;
  step.filled = true;
  ++epoch_;
  next_step(layer);
  int32_t* map = maps_[layer];
  std::vector<int64_t> missing;
  for (int64_t e : experts) {
    if (const int32_t slot = map[e]; slot >= 0) {
      mark_[slot] = epoch_;
      used(slot);
    } else {
      missing.push_back(e);
    }
  }
  for (int64_t e : missing) {
    const int64_t slot = victim();
    TORCH_CHECK(slot >= 0, "no slot left for layer ", layer, "'s expert ", e);  // experts <= slots: unreachable
    step.fills.push_back(claim(slot, layer, e));
    filled(slot, 1);
  }
  if (ahead_layer >= 0) {
    std::vector<int64_t> wanted;  // a predicted expert that is held stays, as this layer-step's own do
    for (int64_t e : ahead) {
      if (const int32_t slot = maps_[ahead_layer][e]; slot >= 0) {
        mark_[slot] = epoch_;
      } else {
        wanted.push_back(e);
      }
    }
    for (int64_t e : wanted) {
      const int64_t slot = victim();
      if (slot < 0) break;  // every slot is this layer-step's
      step.reserved.push_back(claim(slot, ahead_layer, e));
      filled(slot, 0);
    }
    step.ahead_layer = ahead_layer;
  }
  // One submission: this layer-step's runs of adjacent records first, then the reads ahead.
  const auto own = runs(layer, step.fills), later = ahead_layer >= 0 ? runs(ahead_layer, step.reserved) : std::vector<Run>{};
  std::vector<Run> all(own);
  all.insert(all.end(), later.begin(), later.end());
  const auto tickets = submit(all);
  int64_t failure = 0;
  for (size_t i = 0; i < own.size(); ++i) {
    const int64_t result = tickets[i] >= 0 ? std::get<0>(reads_->wait(tickets[i])) : tickets[i];
    const int64_t size = static_cast<int64_t>(own[i].slots.size()) * record_;
    if (result != size) {  // its slots hold nothing: free again
      failure = failure ? failure : (result < 0 ? -result : EIO);
      drop(own[i], step);
      continue;
    }
    for (size_t j = 0; j < own[i].slots.size(); ++j) map[own[i].first + j] = static_cast<int32_t>(own[i].slots[j]);
    step.bytes += size;
  }
  for (size_t i = 0; i < later.size(); ++i) {
    if (tickets[own.size() + i] < 0) {
      drop(later[i], step);
    } else {
      ahead_.push_back({tickets[own.size() + i], later[i]});
    }
  }
  step.fill_seconds = seconds_since(began);
  auto& logged = log_.emplace_back(std::move(step));
  if (failure) {
    throw StoreReadError(static_cast<int>(failure), std::generic_category(), "reading layer " + std::to_string(layer) + "'s experts from the expert store");
  }
  return logged;
}

void ExpertBank::land_all() {
  if (ahead_.empty()) return;
  auto step = land(-1, {});
  log_.push_back(std::move(step));
}

ExpertBank::LayerStep ExpertBank::land(int64_t layer, const std::vector<int64_t>& routed) {
  LayerStep step;
  for (const auto& read : ahead_) {
    const int64_t result = std::get<0>(reads_->wait(read.ticket));
    if (result != static_cast<int64_t>(read.run.slots.size()) * record_) {  // a layer-step that routes to them reads them again
      drop(read.run, step);
      continue;
    }
    for (size_t j = 0; j < read.run.slots.size(); ++j) {
      const int64_t e = read.run.first + static_cast<int64_t>(j);
      maps_[read.run.layer][e] = static_cast<int32_t>(read.run.slots[j]);
      step.used += read.run.layer == layer && std::binary_search(routed.begin(), routed.end(), e);
    }
    step.landed += static_cast<int64_t>(read.run.slots.size());
  }
  ahead_.clear();
  return step;
}

std::vector<ExpertBank::LayerStep> ExpertBank::take_log() {
  std::vector<LayerStep> taken;
  taken.swap(log_);
  return taken;
}

void ExpertBank::to_back(int64_t slot) {
  queue_.emplace_back(slot, ++stamp_[slot]);
  if (queue_.size() > static_cast<size_t>(4 * slots())) compact();  // stale entries stay bounded, steps without a fill included
}

void ExpertBank::next_step(int64_t layer) {
  if (!lfu_) return;
  if (layer <= layer_ && ++passes_ % aging_passes_ == 0) {
    for (auto& count : count_) count >>= 1;
  }
  layer_ = layer;
  ++step_;
}

void ExpertBank::used(int64_t slot) {
  if (lfu_) {
    ++count_[slot];
    last_[slot] = step_;
  } else {
    to_back(slot);
  }
}

void ExpertBank::filled(int64_t slot, int64_t uses) {
  if (lfu_) {
    count_[slot] = uses;
    last_[slot] = step_;
  } else if (uses > 0) {
    to_back(slot);
  } else {
    queue_.emplace_front(slot, ++stamp_[slot]);
  }
}

int64_t ExpertBank::victim() {
  if (!free_.empty()) {
    const int64_t slot = free_.back();
    free_.pop_back();
    return slot;
  }
  return lfu_ ? least_used() : least_recent();
}

int64_t ExpertBank::least_used() const {
  int64_t found = -1, best = 0;
  for (int64_t slot = 0; slot < slots(); ++slot) {
    if (key_of_[slot] < 0 || mark_[slot] == epoch_) continue;
    const int64_t score = count_[slot] * (step_ + 1) - last_[slot];  // the fewest uses, then the most recent
    if (found < 0 || score < best) found = slot, best = score;
  }
  return found;
}

int64_t ExpertBank::least_recent() {
  std::vector<std::pair<int64_t, uint64_t>> kept;  // this layer-step's own slots met at the front: they stay there
  int64_t found = -1;
  while (!queue_.empty()) {
    const auto entry = queue_.front();
    queue_.pop_front();
    if (entry.second != stamp_[entry.first] || key_of_[entry.first] < 0) continue;  // moved since, or free
    if (mark_[entry.first] == epoch_) {
      kept.push_back(entry);
      continue;
    }
    found = entry.first;
    break;
  }
  for (auto it = kept.rbegin(); it != kept.rend(); ++it) queue_.push_front(*it);
  return found;
}

void ExpertBank::compact() {
  std::deque<std::pair<int64_t, uint64_t>> live;
  for (const auto& entry : queue_) {
    if (entry.second == stamp_[entry.first]) live.push_back(entry);
  }
  queue_.swap(live);
}

ExpertBank::Claim ExpertBank::claim(int64_t slot, int64_t layer, int64_t expert) {
  Claim claimed{expert, slot, -1, -1};
  if (const int64_t key = key_of_[slot]; key >= 0) {
    claimed[2] = key / experts_;
    claimed[3] = key % experts_;
    maps_[claimed[2]][claimed[3]] = -1;
  }
  key_of_[slot] = layer * experts_ + expert;
  mark_[slot] = epoch_;
  return claimed;
}

std::vector<ExpertBank::Run> ExpertBank::runs(int64_t layer, const std::vector<Claim>& claims) const {
  std::vector<Run> out;
  for (const auto& claimed : claims) {
    if (out.empty() || claimed[0] != out.back().first + static_cast<int64_t>(out.back().slots.size()) ||
        static_cast<int64_t>(out.back().slots.size()) == READ_MOST) {
      out.push_back({layer, claimed[0], {}});
    }
    out.back().slots.push_back(claimed[1]);
  }
  return out;
}

std::tuple<int64_t, std::vector<int64_t>> ExpertBank::request(const Run& run) const {
  std::vector<int64_t> addresses;
  for (int64_t slot : run.slots) addresses.push_back(reinterpret_cast<int64_t>(base_ + slot * record_));
  return {(run.layer * experts_ + run.first) * record_, std::move(addresses)};
}

std::vector<int64_t> ExpertBank::submit(const std::vector<Run>& runs) {
  std::vector<int64_t> tickets(runs.size(), -EIO);
  std::vector<size_t> queued;
  std::vector<std::tuple<int64_t, std::vector<int64_t>>> requests;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (std::find(failing_.begin(), failing_.end(), std::array<int64_t, 2>{runs[i].layer, runs[i].first}) != failing_.end()) continue;
    queued.push_back(i);
    requests.push_back(request(runs[i]));
    ++runs_read_;
  }
  if (!requests.empty()) {
    const auto submitted = reads_->submit(fd_, requests, record_);
    for (size_t j = 0; j < queued.size(); ++j) tickets[queued[j]] = submitted[j];
  }
  return tickets;
}

void ExpertBank::drop(const Run& run, LayerStep& step) {
  for (size_t j = 0; j < run.slots.size(); ++j) {
    key_of_[run.slots[j]] = -1;
    free_.push_back(run.slots[j]);
    step.dropped.push_back({run.layer, run.first + static_cast<int64_t>(j)});
  }
}
