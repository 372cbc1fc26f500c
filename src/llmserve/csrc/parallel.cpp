// The spinning thread pool behind llmserve::parallel_for (see parallel.h).

#include "parallel.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace llmserve {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long an idle worker spins before it sleeps (LLMSERVE_CPU_POOL_SPIN_US): longer than
// the gaps between one step's loops and than the host's work between two steps, so that a
// busy engine never waits for a worker to wake, yet idle cores are soon given back.
std::chrono::microseconds spin_time() {
  const char* v = std::getenv("LLMSERVE_CPU_POOL_SPIN_US");
  return std::chrono::microseconds(v != nullptr ? std::atol(v) : 1000);
}
const std::chrono::microseconds kSpin = spin_time();
// How long the caller spins for the workers' chunks before it yields its core between checks.
constexpr auto kYieldAfter = std::chrono::microseconds(100);

class Pool {
 public:
  explicit Pool(int threads) : threads_(threads), pid_(getpid()) {
    for (int t = 1; t < threads_; ++t) workers_.emplace_back([this, t] { worker(t); });
  }

  // Its workers finish the chunk in hand and exit; the object is never freed (a loop of
  // another host thread may still hold it).
  void retire() {
    stop_.store(true, std::memory_order_seq_cst);
    {
      std::lock_guard<std::mutex> lk(sleep_mu_);
      sleep_cv_.notify_all();
    }
    for (auto& w : workers_) w.detach();
  }

  int threads() const { return threads_; }
  pid_t pid() const { return pid_; }

  bool run(int64_t begin, int64_t end, int64_t grain, const ChunkFn& fn) {
    if (!dispatch_.try_lock()) return false;  // another host thread's loop is running
    std::lock_guard<std::mutex> held(dispatch_, std::adopt_lock);
    if (stop_.load(std::memory_order_seq_cst)) return false;
    const int64_t range = end - begin;
    int64_t n = threads_;
    if (grain > 0) n = std::min(n, (range + grain - 1) / grain);
    fn_ = &fn;
    begin_ = begin;
    end_ = end;
    nthreads_ = n;
    chunk_ = (range + n - 1) / n;
    failed_.store(false, std::memory_order_relaxed);
    error_ = nullptr;
    remaining_.store(threads_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);  // publishes the loop
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(sleep_mu_);
      sleep_cv_.notify_all();
    }
    run_chunk(0);
    // The workers' chunks: spin, then, should a worker have lost its core (to another
    // process, or to this one's other threads), give ours up while waiting.
    const auto wait_start = std::chrono::steady_clock::now();
    for (int k = 0; remaining_.load(std::memory_order_acquire) > 0; ++k) {
      cpu_relax();
      if ((k & 255) == 255 && std::chrono::steady_clock::now() - wait_start > kYieldAfter)
        std::this_thread::yield();
    }
    fn_ = nullptr;
    if (failed_.load(std::memory_order_relaxed)) std::rethrow_exception(error_);
    return true;
  }

 private:
  void run_chunk(int64_t tid) {
    const int64_t b = begin_ + tid * chunk_;
    if (tid >= nthreads_ || b >= end_) return;
    at::internal::ThreadIdGuard tid_guard(tid);
    c10::ParallelGuard in_loop(true);
    try {
      (*fn_)(b, std::min(end_, b + chunk_));
    } catch (...) {
      if (!failed_.exchange(true)) error_ = std::current_exception();
    }
  }

  void worker(int tid) {
    uint64_t seen = 0;  // no loop is published before the workers exist
    for (;;) {
      auto spin_start = std::chrono::steady_clock::now();
      uint64_t g;
      int k = 0;
      while ((g = generation_.load(std::memory_order_acquire)) == seen) {
        if (stop_.load(std::memory_order_relaxed)) return;
        cpu_relax();
        if ((++k & 255) == 0 && std::chrono::steady_clock::now() - spin_start > kSpin) {
          std::unique_lock<std::mutex> lk(sleep_mu_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          sleep_cv_.wait(lk, [&] {
            return generation_.load(std::memory_order_seq_cst) != seen ||
                   stop_.load(std::memory_order_seq_cst);
          });
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          spin_start = std::chrono::steady_clock::now();
        }
      }
      seen = g;
      run_chunk(tid);
      remaining_.fetch_sub(1, std::memory_order_release);
    }
  }

  const int threads_;
  const pid_t pid_;
  std::vector<std::thread> workers_;
  std::mutex dispatch_;
  // The loop being run, written before the generation's increment publishes it.
  const ChunkFn* fn_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0, nthreads_ = 0;
  std::exception_ptr error_;
  std::atomic<bool> failed_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
};

bool env_enabled() {
  const char* v = std::getenv("LLMSERVE_CPU_POOL");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

std::atomic<bool> g_enabled{env_enabled()};
std::mutex g_pool_mu;
std::atomic<Pool*> g_pool{nullptr};  // replaced when the thread count changes or after a fork

Pool* pool_for(int threads) {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr && p->threads() == threads && p->pid() == getpid()) return p;
  std::lock_guard<std::mutex> lk(g_pool_mu);
  p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr && p->pid() == getpid() && p->threads() == threads) return p;
  // After a fork the parent's workers do not exist here: the old pool is dropped as it is.
  if (p != nullptr && p->pid() == getpid()) p->retire();
  p = new Pool(threads);
  g_pool.store(p, std::memory_order_release);
  return p;
}

}  // namespace

bool pool_parallel_for(int64_t begin, int64_t end, int64_t grain, const ChunkFn& fn) {
  if (!g_enabled.load(std::memory_order_relaxed)) return false;
  const int64_t range = end - begin;
  if (range <= grain || range <= 1 || at::in_parallel_region()) return false;
  const int threads = at::get_num_threads();
  if (threads <= 1) return false;
  return pool_for(threads)->run(begin, end, grain, fn);
}

void set_thread_pool(bool enabled) { g_enabled.store(enabled); }
bool thread_pool_enabled() { return g_enabled.load(); }

}  // namespace llmserve
