// The decoder stack's threads kept together for a whole step: one OpenMP region a step, not
// one a kernel.
//
// Every kernel splits its work with at::parallel_for, which opens an OpenMP region per call:
// a fork (libgomp wakes the pool with a futex system call, whether or not a thread sleeps)
// and a join, ~0.75 us on this project's 2-core hosts. A decode step of one sequence calls
// five such kernels a layer (the four projections and attention): 150 regions a step of a
// 30-layer model, ~0.1 ms of a step whose arithmetic the regions wrap is a few microseconds
// a kernel. `run_as_team` opens one region for the stack instead: its first thread runs the
// layers, the others wait for work on a shared counter, and `parallel_for` hands them their
// share and waits for it: an atomic add and a spin, no system call while the wait is short
// (a thread that waits longer sleeps on a futex, and only then does its waker call the
// kernel).
//
// `parallel_for` splits a range exactly as at::parallel_for does (the same chunks to the same
// thread numbers, the same grain rule), so a kernel computes the same items together either
// way; the kernels' results do not depend on the split anyway (each output has one fixed
// order of operations). Outside a team (the module path, the head, any caller from Python)
// it is at::parallel_for. Inside a team's work items, or on a thread of another region, it
// runs the range on the calling thread, as at::parallel_for does in a parallel region.
#pragma once

#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>

namespace llmserve {

class Team;

namespace team_detail {
// The team the calling thread leads, while it runs the stack; null on every other thread.
inline thread_local Team* led = nullptr;

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// A word threads wait on: spun on for up to kSpin, then slept on (a futex), as libgomp's own
// waits do, so that a thread waiting on one the kernel has descheduled (more runnable threads
// than cores: the API server, a client, the engine's I/O thread) gives its core away instead
// of holding it. A writer makes the system call only when a waiter sleeps.
class Signal {
 public:
  uint32_t load() const { return word_.load(std::memory_order_acquire); }

  // Waits until ready(value) holds; returns that value.
  template <class Ready>
  uint32_t wait(const Ready& ready) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 1;; ++i) {
      const uint32_t v = word_.load(std::memory_order_acquire);
      if (ready(v)) return v;
      relax();
      if (i % 256 == 0 && std::chrono::steady_clock::now() - start > kSpin) break;
    }
    // Dekker's handshake with notify(): the sleeper counts itself before it reads the word
    // again, the writer changes the word before it reads the count (both sequentially
    // consistent), so one of them sees the other's write; the futex sleeps only while the
    // word still holds the value read.
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    uint32_t v;
    while (!ready(v = word_.load(std::memory_order_seq_cst)))
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word_), FUTEX_WAIT_PRIVATE, v, nullptr,
              nullptr, 0);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return v;
  }

  // word += delta; wakes the sleepers. Returns the value before.
  uint32_t add(int32_t delta) {
    const uint32_t before = word_.fetch_add(static_cast<uint32_t>(delta),
                                            std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) != 0)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word_), FUTEX_WAKE_PRIVATE, INT32_MAX,
              nullptr, nullptr, 0);
    return before;
  }

  void store(uint32_t v) { word_.store(v, std::memory_order_relaxed); }

 private:
  static constexpr std::chrono::microseconds kSpin{200};
  alignas(64) std::atomic<uint32_t> word_{0};
  std::atomic<uint32_t> sleepers_{0};
};
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex word");

inline int64_t divup(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace team_detail

class Team {
 public:
  int64_t size() const { return size_; }

  // at::parallel_for's split of [begin, end) over the team; returns when every share is done
  // and rethrows the first exception a share threw.
  template <class F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
    if (begin >= end) return;
    const int64_t n = end - begin;
    if (n <= grain || n <= 1 || size_ <= 1 || busy_) {
      f(begin, end);
      return;
    }
    const int64_t threads = grain > 0 ? std::min(size_, team_detail::divup(n, grain)) : size_;
    task_ = Task{&call<F>, &f, begin, end, team_detail::divup(n, threads)};
    error_ = nullptr;
    failed_.clear(std::memory_order_relaxed);
    pending_.store(static_cast<uint32_t>(size_ - 1));
    busy_ = true;
    epoch_.add(1);  // publishes task_ (and pending_) to the others
    run_share(0);
    pending_.wait([](uint32_t left) { return left == 0; });
    busy_ = false;
    if (error_) std::rethrow_exception(error_);
  }

  // Runs body() on the calling thread with a team of the intra-op threads standing by for
  // its parallel_for calls; body() alone where there is no team to be had (one thread, or
  // already inside a parallel region or a team).
  template <class Body>
  friend void run_as_team(const Body& body);

 private:
  struct Task {
    void (*fn)(const void*, int64_t, int64_t);
    const void* f;
    int64_t begin, end, chunk;
  };

  template <class F>
  static void call(const void* f, int64_t b, int64_t e) {
    (*static_cast<const F*>(f))(b, e);
  }

  void run_share(int64_t tid) {
    const int64_t b = task_.begin + tid * task_.chunk;
    if (b >= task_.end) return;
    try {
      task_.fn(task_.f, b, std::min(task_.end, b + task_.chunk));
    } catch (...) {
      if (!failed_.test_and_set()) error_ = std::current_exception();
    }
  }

  // A thread other than the leader: each new epoch is a share to run, or the end.
  void serve(int64_t tid) {
    uint32_t seen = 0;
    for (;;) {
      seen = epoch_.wait([seen](uint32_t epoch) { return epoch != seen; });
      if (done_) return;
      run_share(tid);
      pending_.add(-1);
    }
  }

  void dismiss() {
    done_ = true;
    epoch_.add(1);
  }

  int64_t size_ = 1;
  bool busy_ = false;  // the leader is inside a share: a nested parallel_for runs inline
  bool done_ = false;  // written before the epoch that announces it
  Task task_{};
  std::exception_ptr error_;
  std::atomic_flag failed_ = ATOMIC_FLAG_INIT;
  team_detail::Signal epoch_;    // a new task (or the end) each time it moves
  team_detail::Signal pending_;  // the others' shares still running
};

template <class Body>
void run_as_team(const Body& body) {
  if (at::get_num_threads() <= 1 || at::in_parallel_region() || team_detail::led != nullptr) {
    body();
    return;
  }
  Team team;
  std::exception_ptr error;
  // No num_threads clause, as at::parallel_for (GOMP's pool, pytorch#32008): the team is
  // whatever the region gets.
#pragma omp parallel
  {
    const int64_t tid = omp_get_thread_num();
    if (tid == 0) {
      team.size_ = omp_get_num_threads();  // read by the others only through a task
      team_detail::led = &team;
      try {
        body();
      } catch (...) {
        error = std::current_exception();
      }
      team_detail::led = nullptr;
      team.dismiss();
    } else {
      team.serve(tid);
    }
  }
  if (error) std::rethrow_exception(error);
}

// The threads a kernel's work is split over: its team's, or at::parallel_for's.
inline int64_t num_threads() {
  return team_detail::led != nullptr ? team_detail::led->size() : at::get_num_threads();
}

// A kernel's parallel loop: over the calling thread's team while it leads one (the decoder
// stack), else at::parallel_for.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (team_detail::led != nullptr)
    team_detail::led->parallel_for(begin, end, grain, f);
  else
    at::parallel_for(begin, end, grain, f);
}

}  // namespace llmserve
