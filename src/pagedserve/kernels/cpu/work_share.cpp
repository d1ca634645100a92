// The helper thread and run() of work_share.h (the protocol is described there).

#include "work_share.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

namespace pagedserve {
namespace work_share {
namespace {

// A chunk's state. A chunk claimed from the counter by the engine is written kDone by it alone;
// one claimed by the helper moves kOpen -> kHelper -> kCommitting -> kDone, unless the engine
// moves it from kOpen or kHelper to kStolen first.
enum : uint8_t { kOpen = 0, kHelper = 1, kCommitting = 2, kDone = 3, kStolen = 4 };

struct Job {
  Job(std::shared_ptr<Task> t, int64_t n, int64_t g)
      : task(std::move(t)), units(n), grain(g), chunks((n + g - 1) / g), state(new std::atomic<uint8_t>[chunks]) {
    for (int64_t c = 0; c < chunks; ++c) state[c].store(kOpen, std::memory_order_relaxed);
  }
  std::shared_ptr<Task> task;
  const int64_t units, grain, chunks;
  std::atomic<int64_t> next{0};
  std::unique_ptr<std::atomic<uint8_t>[]> state;
  int64_t begin(int64_t c) const { return c * grain; }
  int64_t end(int64_t c) const { return std::min(units, (c + 1) * grain); }
};

// How long the helper spins for the next call before it sleeps (with the helper off it sleeps at
// once). The ops between two shared kernels (attention, norms, the Python between layers) can last
// a millisecond or more at 64 sequences; a helper asleep by then is woken through the kernel, and
// beside a neighbour a woken thread waits for the CPU again: measured on 2 cores, a 0.5 ms spin
// left the helper asleep nearly half of a run. Spinning costs only the core share the helper has.
constexpr auto kSpin = std::chrono::milliseconds(5);

class Helper {
 public:
  static Helper& get() {
    static Helper* helper = new Helper();  // never destroyed: the thread may outlive static teardown
    return *helper;
  }

  int64_t set(bool on, int64_t cpu) {
    if (on) {
      std::call_once(started_, [this] { std::thread(&Helper::loop, this).detach(); });
      while (tid_.load() == 0) std::this_thread::yield();
      pin(cpu);
      owner_.store(pthread_self());
    }
    on_.store(on);
    if (!on) {
      // Once the helper is past its last job (it may be finishing a chunk taken back from it),
      // release what it is done with here: the model's weights may be among it.
      while (awake_.load()) std::this_thread::yield();
      publish(nullptr);
    }
    return tid_.load();
  }

  bool sharing() const { return on_.load(std::memory_order_relaxed) && pthread_equal(owner_.load(), pthread_self()); }

  // On the engine thread only. Jobs the helper is done with are released here, not on the helper:
  // a task's tensors may be Python tensors, whose last release takes the GIL, which the engine
  // thread holds while it runs a kernel (measured: a helper releasing them slept on the GIL 80% of
  // the time).
  void publish(std::shared_ptr<Job> job) {
    std::vector<std::shared_ptr<Job>> done;
    {
      Locked lock(lock_);
      job_.swap(job);
      done.swap(retired_);
    }
    generation_.fetch_add(1);  // seq_cst, paired with the helper's sleeping_ store (see loop)
    if (sleeping_.load()) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_one();
    }
  }  // the previous job and the retired ones released here
  void retract() {
    std::shared_ptr<Job> job;
    Locked lock(lock_);
    job_.swap(job);
  }

  std::atomic<int64_t> committed{0}, stolen{0}, delay_us{0};
  int64_t tid() const { return tid_.load(); }

 private:
  void pin(int64_t cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (cpu >= 0) {
      CPU_SET(static_cast<int>(cpu), &set);
    } else if (sched_getaffinity(0, sizeof(set), &set) != 0) {  // unpinned: the process's mask
      return;
    }
    pthread_setaffinity_np(handle_, sizeof(set), &set);
  }

  void loop() {
    handle_ = pthread_self();
    pthread_setname_np(handle_, "pagedserve-help");
    tid_.store(static_cast<int64_t>(syscall(SYS_gettid)));
    uint64_t seen = generation_.load();
    auto last = std::chrono::steady_clock::now();
    for (;;) {
      awake_.store(true);  // before the generation is read: set(false) waits for the helper to sleep
      const uint64_t generation = generation_.load();
      if (generation != seen) {
        seen = generation;
        std::shared_ptr<Job> job;
        {
          Locked lock(lock_);
          job = job_;
        }
        if (job) {
          work(*job);
          Locked lock(lock_);
          retired_.push_back(std::move(job));  // released by the engine thread (publish)
        }
        last = std::chrono::steady_clock::now();
        continue;
      }
      if (on_.load(std::memory_order_relaxed) && std::chrono::steady_clock::now() - last < kSpin) {
        _mm_pause();
        continue;
      }
      awake_.store(false);
      std::unique_lock<std::mutex> lock(mutex_);
      sleeping_.store(true);  // seq_cst: publish() sees it, or this thread sees the new generation
      wake_.wait(lock, [&] { return generation_.load() != seen; });
      sleeping_.store(false);
      last = std::chrono::steady_clock::now();
    }
  }

  void work(Job& job) {
    const size_t bytes = job.task->scratch_bytes();
    if (scratch_bytes_ < bytes) {
      std::free(scratch_);
      scratch_bytes_ = (bytes + 63) / 64 * 64;
      scratch_ = std::aligned_alloc(64, scratch_bytes_);
    }
    for (int64_t c; (c = job.next.fetch_add(1)) < job.chunks;) {
      uint8_t expected = kOpen;
      if (!job.state[c].compare_exchange_strong(expected, kHelper)) continue;  // taken back already
      if (const int64_t us = delay_us.load(std::memory_order_relaxed)) {
        std::this_thread::sleep_for(std::chrono::microseconds(us));
      }
      job.task->compute(job.begin(c), job.end(c), scratch_);
      expected = kHelper;
      if (job.state[c].compare_exchange_strong(expected, kCommitting)) {
        job.task->commit(job.begin(c), job.end(c), scratch_);
        job.state[c].store(kDone, std::memory_order_release);
        committed.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  std::once_flag started_;
  pthread_t handle_{};
  std::atomic<int64_t> tid_{0};
  std::atomic<bool> on_{false};
  std::atomic<pthread_t> owner_{};
  // A spin lock, not a mutex: a blocked helper would sleep in the kernel and wake late; the
  // sections it guards are a few pointer moves.
  struct Locked {
    explicit Locked(std::atomic<bool>& flag) : flag_(flag) {
      while (flag_.exchange(true, std::memory_order_acquire)) _mm_pause();
    }
    ~Locked() { flag_.store(false, std::memory_order_release); }
    std::atomic<bool>& flag_;
  };
  std::atomic<bool> lock_{false};
  std::shared_ptr<Job> job_;                   // the call to help with, under lock_
  std::vector<std::shared_ptr<Job>> retired_;  // jobs the helper is done with, under lock_
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> awake_{false};  // between waking and going to sleep: may take a job
  std::mutex mutex_;
  std::condition_variable wake_;
  void* scratch_ = nullptr;  // the helper thread's alone
  size_t scratch_bytes_ = 0;
};

}  // namespace

bool sharing() { return Helper::get().sharing() && at::get_num_threads() == 1; }

void run(std::shared_ptr<Task> task, int64_t units, int64_t grain) {
  if (units <= 0) return;
  Helper& helper = Helper::get();
  auto job = std::make_shared<Job>(std::move(task), units, std::max<int64_t>(1, grain));
  helper.publish(job);
  Task& t = *job->task;
  for (int64_t c; (c = job->next.fetch_add(1)) < job->chunks;) {
    t.compute(job->begin(c), job->end(c), nullptr);
    job->state[c].store(kDone, std::memory_order_relaxed);
  }
  for (int64_t c = 0; c < job->chunks; ++c) {
    for (uint8_t s = job->state[c].load(std::memory_order_acquire); s != kDone;
         s = job->state[c].load(std::memory_order_acquire)) {
      if (s == kCommitting) {
        _mm_pause();  // the helper is copying its result in
      } else if (job->state[c].compare_exchange_strong(s, kStolen)) {
        t.compute(job->begin(c), job->end(c), nullptr);
        helper.stolen.fetch_add(1, std::memory_order_relaxed);
        break;
      }
    }
  }
  helper.retract();
}

void copy_columns(void* dst, const void* src, int64_t rows, int64_t ld, int64_t c0, int64_t c1, size_t elem) {
  const size_t row_bytes = static_cast<size_t>(ld) * elem, bytes = static_cast<size_t>(c1 - c0) * elem;
  char* d = static_cast<char*>(dst) + c0 * elem;
  const char* s = static_cast<const char*>(src) + c0 * elem;
  for (int64_t r = 0; r < rows; ++r) std::memcpy(d + r * row_bytes, s + r * row_bytes, bytes);
}

int64_t set_helper(bool on, int64_t helper_cpu) { return Helper::get().set(on, helper_cpu); }

std::vector<int64_t> helper_stats() {
  Helper& h = Helper::get();
  return {h.tid(), h.committed.load(), h.stolen.load()};
}

void set_helper_test_delay_us(int64_t us) { Helper::get().delay_us.store(us); }

}  // namespace work_share
}  // namespace pagedserve
