// Binds the calling thread's OpenMP team, the threads torch's parallel ops run on, one thread
// to one CPU.
//
// GNU OpenMP's threads spin between ops (GOMP_SPINCOUNT, 300k turns by default) before they
// sleep. Unbound, with a busy process beside the engine on one of two cores, the scheduler puts
// both of the model's threads on one core at times, and then each op's barrier waits out the
// spinner's time slice: a 128-token SmolLM2 prefill took 2.7-3.1 s against 85 ms alone, a
// one-row decode step 0.76-0.97 s against 14 ms. Bound, the two never share a core: 307-318 and
// 46-49 ms beside the same neighbour, level alone (2-core Zen 4, the engine core in its own
// process; benchmarks/results/thread_binding_zen4/).
// A thread created later inherits its creator's CPU (workers/cpu_binding.py says how the
// engine's own threads undo that).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// Thread t of a team of cpus.size() runs on cpus[t] from now on, the calling thread (t = 0)
// included. Returns each thread's kernel id, in team order.
std::vector<int64_t> bind_omp_threads(std::vector<int64_t> cpus) {
  const int n = static_cast<int>(cpus.size());
  if (n < 1) throw std::invalid_argument("bind_omp_threads: no CPU given");
  std::vector<int64_t> tids(n, -1);
  std::vector<int> errors(n, 0);
  int team = 0;
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    if (t == 0) team = omp_get_num_threads();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[t]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) errors[t] = errno;
    tids[t] = static_cast<int64_t>(syscall(SYS_gettid));
  }
  if (team != n) throw std::runtime_error("bind_omp_threads: OpenMP gave a team of " + std::to_string(team) + " threads, not " + std::to_string(n));
  for (int t = 0; t < n; ++t)
    if (errors[t] != 0) throw std::runtime_error("bind_omp_threads: CPU " + std::to_string(cpus[t]) + ": errno " + std::to_string(errors[t]));
  return tids;
}

// The kernel ids of the calling thread's team of `n` (the threads a torch op of n threads runs on).
std::vector<int64_t> omp_team_tids(int64_t n) {
  std::vector<int64_t> tids(n, -1);
#pragma omp parallel num_threads(static_cast<int>(n))
  tids[omp_get_thread_num()] = static_cast<int64_t>(syscall(SYS_gettid));
  return tids;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("bind_omp_threads(int[] cpus) -> int[]", &bind_omp_threads);  // no tensor to dispatch on
  m.def("omp_team_tids(int n) -> int[]", &omp_team_tids);
}
