// Sharing a kernel call between the engine thread and a helper thread that the OS may deschedule
// at any moment (a busy neighbour on its core), without the engine thread ever waiting for it.
//
// Why (issue 30). Beside one busy neighbour core, an OpenMP team of two waits at the end of every
// op for the thread that shares its core: that thread is descheduled for whole time slices
// (milliseconds) while an op lasts a fraction of one. The thread governor (core/thread_governor.py)
// then drops to one thread, which leaves unused the half core the neighbour does not take. The
// helper takes that half core for the linear kernels (with the LM head's fused argmax) and decode
// attention, with no barrier anywhere.
//
// How. A call's output is cut into chunks (a few of the kernel's 32-column groups, or decode
// attention's work items, each). The engine
// thread and the helper claim chunks from one counter. The engine computes its chunks straight
// into the output. The helper computes into its own scratch and copies a chunk into the output
// only after winning the chunk's state (claimed -> committing). When the counter runs out the
// engine takes back every chunk the helper holds but has not committed (claimed -> stolen) and
// computes it itself: it waits only for a copy in progress, never for a descheduled helper's
// compute. The helper may go on computing a chunk taken from it after the call returned: what it
// reads is kept alive by the task it holds (tensor references, copied parameters), and it writes
// only its scratch, whose commit then fails. Engine and helper run the same code on a chunk, so the
// output is bit for bit the one-thread result whoever computed what.
//
// Only the thread that turned the helper on shares (the engine thread, at one OpenMP thread); any
// other caller, and the helper itself, runs kernels as before.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace pagedserve {
namespace work_share {

// Whether a kernel called on this thread now should go through run(): the helper is on, this is
// the thread that turned it on, and torch computes with one thread here.
bool sharing();

class Task {
 public:
  virtual ~Task() = default;
  // Units [u0, u1) into the output (scratch null, on the engine thread) or into scratch (the
  // helper's buffer of scratch_bytes(), laid out as the task decides).
  virtual void compute(int64_t u0, int64_t u1, void* scratch) = 0;
  // Units [u0, u1) copied from the helper's scratch into the output.
  virtual void commit(int64_t u0, int64_t u1, const void* scratch) = 0;
  virtual size_t scratch_bytes() const = 0;
};

// Units [0, units) in chunks of `grain` units, shared with the helper; returns once every unit is
// in the output.
void run(std::shared_ptr<Task> task, int64_t units, int64_t grain);

// A Task from two callables, each holding by value what it reads (tensors it keeps alive included:
// the helper may call them after run() has returned).
template <class Compute, class Commit>
class CallableTask final : public Task {
 public:
  CallableTask(size_t scratch_bytes, Compute compute, Commit commit)
      : bytes_(scratch_bytes), compute_(std::move(compute)), commit_(std::move(commit)) {}
  void compute(int64_t u0, int64_t u1, void* scratch) override { compute_(u0, u1, scratch); }
  void commit(int64_t u0, int64_t u1, const void* scratch) override { commit_(u0, u1, scratch); }
  size_t scratch_bytes() const override { return bytes_; }

 private:
  size_t bytes_;
  Compute compute_;
  Commit commit_;
};

template <class Compute, class Commit>
void run(int64_t units, int64_t grain, size_t scratch_bytes, Compute compute, Commit commit) {
  run(std::make_shared<CallableTask<Compute, Commit>>(scratch_bytes, std::move(compute), std::move(commit)), units,
      grain);
}

// The common case: units of `cols` columns of a [rows, ld] output of `elem`-byte values, at out.
// compute(u0, u1, dst) writes units [u0, u1)'s columns into dst: the output, or on the helper its
// scratch of the output's shape, whose columns are then copied over.
template <class Compute>
void run_columns(int64_t units, int64_t cols, void* out, int64_t rows, int64_t ld, size_t elem, Compute compute);

// Chunk size for a call of `units` units: small enough that a chunk taken back costs the engine
// little, large enough that claiming stays rare next to computing.
inline int64_t grain_for(int64_t units) { return std::max<int64_t>(1, units / 48); }

// Copies columns [c0, c1) of `rows` rows (row stride ld, element size elem) from src to dst: a
// helper's full-shape scratch into the output.
void copy_columns(void* dst, const void* src, int64_t rows, int64_t ld, int64_t c0, int64_t c1, size_t elem);

template <class Compute>
void run_columns(int64_t units, int64_t cols, void* out, int64_t rows, int64_t ld, size_t elem, Compute compute) {
  run(
      units, grain_for(units), static_cast<size_t>(rows * ld) * elem,
      [compute, out](int64_t u0, int64_t u1, void* scratch) { compute(u0, u1, scratch != nullptr ? scratch : out); },
      [=](int64_t u0, int64_t u1, const void* scratch) {
        copy_columns(out, scratch, rows, ld, u0 * cols, u1 * cols, elem);
      });
}

// Bindings (work_share.cpp): turning the helper on for the calling thread (pinned to helper_cpu;
// < 0: the calling thread's CPUs), or off (returns once the helper sleeps, having released what
// it held); its thread id (0 before it started); counters and a test delay.
int64_t set_helper(bool on, int64_t helper_cpu);
std::vector<int64_t> helper_stats();  // {thread id, chunks the helper committed, chunks taken back}
void set_helper_test_delay_us(int64_t us);

}  // namespace work_share
}  // namespace pagedserve
