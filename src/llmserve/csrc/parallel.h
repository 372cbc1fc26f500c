// parallel_for for the kernels: at::parallel_for's contract and partition, run on a pool of
// workers that wait for work by spinning (briefly) instead of in OpenMP's barrier.
//
// A decode step at one token runs ~5 parallel loops a layer (four projections and the
// attention), each a few microseconds of arithmetic. An OpenMP parallel region costs about
// as much again to open and close: libgomp wakes its team and releases it from the closing
// barrier with a futex system call each time, whether a thread sleeps or not. Here the
// calling thread publishes the loop with one atomic increment, the workers (spinning on it
// since their last loop) take their chunks, and the caller spins until they are done; a
// worker that has spun 1 ms without work (LLMSERVE_CPU_POOL_SPIN_US) sleeps on a condition
// variable, and only then does a call pay for a wake-up. (llama.cpp's ggml thread pool
// works the same way.)
//
// Chunks are at::parallel_for's (OpenMP backend): n = min(threads, ceil(range / grain))
// threads, thread t takes [begin + t * chunk, ...) with chunk = ceil(range / n), on thread
// t (at::get_thread_num() reads t). Kernels decide which elements are computed together by
// these chunks, never how one is, so the bits are those of at::parallel_for either way.
//
// Inside a loop (a nested call), in a second host thread while one loop runs, with one
// thread, or with the pool switched off (set_thread_pool(false), LLMSERVE_CPU_POOL=0) the
// call is at::parallel_for's.

#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <type_traits>

namespace llmserve {

// A non-owning reference to a callable (f lives on the caller's stack for the call).
class ChunkFn {
 public:
  template <class F>
  explicit ChunkFn(const F& f)
      : obj_(static_cast<const void*>(&f)), call_([](const void* o, int64_t b, int64_t e) {
          (*static_cast<const F*>(o))(b, e);
        }) {}
  void operator()(int64_t b, int64_t e) const { call_(obj_, b, e); }

 private:
  const void* obj_;
  void (*call_)(const void*, int64_t, int64_t);
};

// Runs fn's chunks on the pool; false when the pool cannot take this call (then nothing ran).
bool pool_parallel_for(int64_t begin, int64_t end, int64_t grain, const ChunkFn& fn);
void set_thread_pool(bool enabled);
bool thread_pool_enabled();

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  if (!pool_parallel_for(begin, end, grain, ChunkFn(f))) at::parallel_for(begin, end, grain, f);
}

}  // namespace llmserve
