// How fast this host reads memory in pieces at random places of a 2 GiB pool (as the CPU
// attention kernel reads KV blocks), against pieces large enough to stream: 2 threads, each
// summing its share of 192 MB of pieces, optionally with software prefetches `ahead` pieces
// ahead, optionally in transparent huge pages (HUGE=1).
//
//   g++ -O2 -fopenmp -mavx512f benchmarks/scattered_reads.cpp -o /tmp/scattered_reads
//   for c in 1024 3072 65536; do /tmp/scattered_reads $c 0; HUGE=1 /tmp/scattered_reads $c 0; done
//
// A KV block of 16 tokens of one head (int8, head dim 64) is 1 KiB; of 32 tokens 2 KiB. The
// block's three heads (SmolLM2) lie side by side.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s PIECE_BYTES AHEAD\n", argv[0]);
    return 2;
  }
  const size_t piece = std::atol(argv[1]);
  const int ahead = std::atoi(argv[2]);
  const size_t pool = 2ul << 30, pieces = pool / piece;
  char* buf = static_cast<char*>(std::aligned_alloc(1 << 21, pool));
  if (std::getenv("HUGE")) madvise(buf, pool, MADV_HUGEPAGE);
  for (size_t i = 0; i < pool; i += 4096) buf[i] = 1;
  std::vector<size_t> order(pieces);
  for (size_t i = 0; i < pieces; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  const size_t per_round = (192ul << 20) / piece;
  for (int round = 0; round < 3; ++round) {
    const auto start = std::chrono::steady_clock::now();
    long total = 0;
#pragma omp parallel num_threads(2) reduction(+ : total)
    {
      const int t = omp_get_thread_num();
      __m512i acc = _mm512_setzero_si512();
      const size_t lo = t * per_round / 2 + round * per_round;
      const size_t hi = (t + 1) * per_round / 2 + round * per_round;
      for (size_t i = lo; i < hi; ++i) {
        if (ahead) {
          const char* next = buf + order[(i + ahead) % pieces] * piece;
          for (size_t o = 0; o < piece; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
        }
        const char* p = buf + order[i % pieces] * piece;
        for (size_t o = 0; o < piece; o += 64)
          acc = _mm512_add_epi32(acc, _mm512_load_si512(p + o));
      }
      total += _mm512_reduce_add_epi32(acc);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("pieces of %zu bytes, prefetch %d ahead%s: %.1f GB/s (%ld)\n", piece, ahead,
                std::getenv("HUGE") ? ", huge pages" : "", per_round * piece / s / 1e9, total);
  }
}
