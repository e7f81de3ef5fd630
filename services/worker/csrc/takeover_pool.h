// A thread pool for the few-row calls of a decode step (products, attention, greedy sampling's argmax),
// whose caller never waits on a helper that is not running.
//
// The worker's threads share their cores with the stack's other processes. When a service wakes, the
// kernel preempts one of the worker's threads for ~0.1-0.3 ms. In an OpenMP region the calling thread
// then waits at the region's end for the preempted thread to come back and finish the item it holds,
// although a product call of a one-row step lasts only ~40 us: a wake-up costs the step the whole
// preemption, while the caller's core spins.
//
// Here the caller (the worker's main thread) goes on without a helper that is not running:
// - a job's items are taken as in shared_items.h (each thread from the front of its own share, then
//   from the back of the others');
// - a helper computes an item into its own scratch, then commits it: a compare-and-swap on the item's
//   state decides whether it copies its result into the output or throws it away;
// - once no item is left to take, the caller waits for the helpers' items in progress for a few times
//   its own mean item time; an item still running then is taken over (computed by the caller) and the
//   helper's later commit fails, so a helper never writes into an output after its call has returned;
// - a helper still in a job after its call returned reads only what the job owns (the rounded
//   activations, the tensors it holds). The caller's pool keeps such a job until the helper has left
//   it, and frees it on the caller's thread: a tensor's last release may take the GIL, which the
//   caller holds and a helper must never wait for.
// shared/cpu_placement.py keeps the stack's other processes off the caller's core, so that a wake-up
// preempts a helper, which costs the step at most that helper's share.
//
// Which thread computes an item does not change its arithmetic: the results are the same bits at every
// thread count, whatever is taken over.
#pragma once

#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "shared_items.h"

namespace takeover_pool {

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Calls of up to this many rows may use the pool (``max_rows``, which the runner sets): decode steps of up
// to 32 streams. Such a step must wake no OpenMP region either (runner.py keeps torch's indexing out of
// it; the decoder's small ops and the rounding of activations stay on the calling thread,
// ``keeps_to_caller``): OpenMP's threads spin for a while after a region, on the cores the pool's helpers
// need. From 9 to 32 rows this replaces the wait at an OpenMP region's end for a thread that a service
// preempted (6 % of the main thread's time at 32 rows) by the takeover, at the price of the small ops on
// one thread. Measured through the stack (chat-128, alternating rounds against the former limit of 8):
// 1.04-1.05x output tokens/s at 16 streams, 1.00-1.04x (mean 1.02x over 5 runs) at 32; the step in
// process unchanged.
constexpr int64_t MAX_ROWS = 32;

// An item's state; an item is taken by exactly one thread through its share.
enum : uint32_t { RUNNING = 0, TAKEN_OVER = 1, COMMITTING = 2, DONE = 3 };

// Whether few-row calls run on the pool. The runner turns it on where every parallel kernel of a few-row
// step does (the int4 dense decoder's one-call steps and their lm_head): beside kernels that run on
// OpenMP's threads, two pools' idle threads would spin on the same cores.
inline std::atomic<bool>& enabled() {
  static std::atomic<bool> on{false};
  return on;
}

// The most rows of a call on the pool, at most MAX_ROWS: the runner lowers it where steps of more rows
// run kernels that the pool does not (int4-a8's per-layer steps, whose torch glue may wake OpenMP).
inline std::atomic<int64_t>& max_rows() {
  static std::atomic<int64_t> rows{MAX_ROWS};
  return rows;
}

// Whether a call of this many rows runs on the pool (else on OpenMP's threads).
inline bool runs_on_pool(int64_t rows) {
  return enabled().load(std::memory_order_relaxed) && rows <= max_rows().load(std::memory_order_relaxed) && at::get_num_threads() > 1;
}

// Whether a small op of this many rows (a norm, an activation, rounding activations) stays on the calling
// thread: in a step whose big calls run on the pool, splitting it would wake OpenMP's threads.
inline bool keeps_to_caller(int64_t rows) { return enabled().load(std::memory_order_relaxed) && rows <= max_rows().load(std::memory_order_relaxed); }

// What the pool has done, for the worker's instrumentation; and, for tests, a stall each helper makes
// before committing an item (as a preemption would), so that the caller takes its items over.
struct Stats {
  std::atomic<uint64_t> jobs{0}, items{0}, taken_over{0};
  std::atomic<int64_t> helper_stall_us{0};
};
inline Stats& stats() {
  static Stats instance;
  return instance;
}

// What a job computes: compute() an item into scratch (any thread), commit() it into the output.
struct Job {
  int64_t items = 0;
  std::vector<shared_items::Share> shares;
  std::unique_ptr<std::atomic<uint32_t>[]> state;
  std::atomic<int32_t> helpers_inside{0};  // a job is freed by the caller's thread only, once no helper is in it

  virtual ~Job() = default;
  virtual int64_t scratch_floats() const = 0;
  virtual void compute(int64_t item, float* scratch) const = 0;
  virtual void commit(int64_t item, const float* scratch) const = 0;

  void prepare(int64_t count, int64_t threads) {
    items = count;
    shares = shared_items::equal_shares(count, threads);
    state.reset(new std::atomic<uint32_t>[count]);
    for (int64_t i = 0; i < count; ++i) state[i].store(RUNNING, std::memory_order_relaxed);
  }

  int64_t take(int64_t t) { return shared_items::take_next(shares, t); }

  // A helper's item: into its scratch, then into the output unless the caller took it over meanwhile.
  void run_as_helper(int64_t item, float* scratch) {
    compute(item, scratch);
    if (const int64_t stall = stats().helper_stall_us.load(std::memory_order_relaxed); stall > 0)
      std::this_thread::sleep_for(std::chrono::microseconds(stall));
    uint32_t expected = RUNNING;
    if (state[item].compare_exchange_strong(expected, COMMITTING, std::memory_order_acq_rel)) {
      commit(item, scratch);
      state[item].store(DONE, std::memory_order_release);
    }
  }
};

inline long futex(std::atomic<uint32_t>* word, int op, uint32_t value) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op | FUTEX_PRIVATE_FLAG, value, nullptr, nullptr, 0);
}

class Pool {
 public:
  static constexpr auto SPIN = std::chrono::microseconds(200);  // a helper's wait for the next job before it sleeps

  explicit Pool(int64_t helpers) {
    for (int64_t t = 1; t <= helpers; ++t) threads_.emplace_back([this, t] { helper(t); });
  }
  ~Pool() {  // with the GIL held: helpers never take it, so they all come back
    stopping_.store(true);
    generation_.fetch_add(1);
    futex(&generation_, FUTEX_WAKE, INT32_MAX);
    for (auto& thread : threads_) thread.join();
  }
  int64_t size() const { return static_cast<int64_t>(threads_.size()) + 1; }

  // Runs every item of the job (prepared for size() threads) and returns when each is in the output.
  void run(std::shared_ptr<Job> job) {
    // Jobs that helpers have left since: their last reference (tensors that may hold Python objects, whose
    // release takes the GIL, which this thread holds) is dropped here.
    retired_.erase(std::remove_if(retired_.begin(), retired_.end(), [](const auto& j) { return j->helpers_inside.load(std::memory_order_acquire) == 0; }),
                   retired_.end());
    {
      std::lock_guard<std::mutex> lock(job_mutex_);
      job_ = job.get();
    }
    generation_.fetch_add(1, std::memory_order_release);
    if (sleepers_.load(std::memory_order_acquire) > 0) futex(&generation_, FUTEX_WAKE, INT32_MAX);
    thread_local std::vector<float> scratch;  // grown, never cleared: an item reads back only what it wrote
    if (static_cast<int64_t>(scratch.size()) < job->scratch_floats()) scratch.resize(job->scratch_floats());
    int64_t own = 0;
    const auto started = std::chrono::steady_clock::now();
    for (int64_t item; (item = job->take(0)) >= 0; ++own) {
      job->compute(item, scratch.data());
      job->commit(item, scratch.data());
      job->state[item].store(DONE, std::memory_order_release);
    }
    // The helpers' items in progress: a few times this thread's mean item, then taken over.
    const auto per_item = own > 0 ? (std::chrono::steady_clock::now() - started) / own : std::chrono::steady_clock::duration::zero();
    const auto patience = 4 * per_item + std::chrono::microseconds(2);
    for (int64_t item = 0; item < job->items; ++item) {
      const auto since = std::chrono::steady_clock::now();
      for (uint32_t s; (s = job->state[item].load(std::memory_order_acquire)) != DONE;) {
        if (s == RUNNING && std::chrono::steady_clock::now() - since > patience) {
          uint32_t expected = RUNNING;
          if (job->state[item].compare_exchange_strong(expected, TAKEN_OVER, std::memory_order_acq_rel)) {
            stats().taken_over.fetch_add(1, std::memory_order_relaxed);
            job->compute(item, scratch.data());
            job->commit(item, scratch.data());
            job->state[item].store(DONE, std::memory_order_release);
            break;
          }
        }
        spin_pause();
      }
    }
    std::lock_guard<std::mutex> lock(job_mutex_);
    job_ = nullptr;  // no helper enters it from now on
    if (job->helpers_inside.load(std::memory_order_acquire) > 0) retired_.push_back(std::move(job));
  }

 private:
  void helper(int64_t t) {
    // SCHED_IDLE: any other thread that wakes on this core (a service handling a token) preempts the
    // helper at once, which the caller's takeover makes cheap, instead of waiting out its time slice.
    const sched_param idle{0};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
    uint32_t seen = generation_.load();
    std::vector<float> scratch;
    while (!stopping_.load(std::memory_order_relaxed)) {
      const auto since = std::chrono::steady_clock::now();
      uint32_t now;
      int spins = 0;
      while ((now = generation_.load(std::memory_order_acquire)) == seen) {
        if (++spins % 64 == 0 && std::chrono::steady_clock::now() - since > SPIN) {
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          futex(&generation_, FUTEX_WAIT, seen);
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        } else {
          spin_pause();
        }
      }
      seen = now;
      Job* job;
      {
        std::lock_guard<std::mutex> lock(job_mutex_);
        job = job_;
        if (job == nullptr || t >= static_cast<int64_t>(job->shares.size())) continue;
        job->helpers_inside.fetch_add(1, std::memory_order_relaxed);
      }
      if (static_cast<int64_t>(scratch.size()) < job->scratch_floats()) scratch.resize(job->scratch_floats());
      for (int64_t item; (item = job->take(t)) >= 0;) job->run_as_helper(item, scratch.data());
      job->helpers_inside.fetch_sub(1, std::memory_order_release);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex job_mutex_;
  Job* job_ = nullptr;                        // the job helpers may enter, under job_mutex_
  std::vector<std::shared_ptr<Job>> retired_;  // jobs returned from with a helper still in them (caller's thread only)
  std::atomic<uint32_t> generation_{0};
  std::atomic<int32_t> sleepers_{0};
  std::atomic<bool> stopping_{false};
};

// The process's pool, sized to at::get_num_threads() (rebuilt when that changes); nullptr at one thread.
inline Pool* pool() {
  static std::unique_ptr<Pool> instance;
  const int64_t threads = at::get_num_threads();
  if (threads <= 1) return nullptr;
  if (!instance || instance->size() != threads) {
    instance.reset();
    instance = std::make_unique<Pool>(threads - 1);
  }
  return instance.get();
}

// Runs job's count items on the pool; inline, in order, in a parallel region or at one thread. One
// caller at a time uses the pool; another caller meanwhile runs its items itself.
inline void run(const std::shared_ptr<Job>& job, int64_t count) {
  static std::mutex callers;
  std::unique_lock<std::mutex> lock(callers, std::try_to_lock);
  Pool* p = lock.owns_lock() && !at::in_parallel_region() ? pool() : nullptr;
  job->prepare(count, p ? std::min<int64_t>(p->size(), count) : 1);
  if (p == nullptr || count < 2) {
    std::vector<float> scratch(job->scratch_floats());
    for (int64_t item = 0; item < count; ++item) {
      job->compute(item, scratch.data());
      job->commit(item, scratch.data());
    }
    return;
  }
  stats().jobs.fetch_add(1, std::memory_order_relaxed);
  stats().items.fetch_add(count, std::memory_order_relaxed);
  p->run(job);
}

}  // namespace takeover_pool
