// A small fork-join pool: parallel_for over [0, n) in chunks, on N-1 workers plus the caller.
//
// Why not OpenMP: the extension must not link a second OpenMP runtime into processes that
// already carry torch's, and the pool must be usable with the GIL released from any thread.
// Workers spin briefly before sleeping because a decode step calls fill and then apply back to
// back: a sleeping worker takes tens of microseconds to wake, as long as a small job itself.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define MO_PAUSE() _mm_pause()
#else
#define MO_PAUSE() std::this_thread::yield()
#endif

namespace mo {

class ThreadPool {
 public:
  using Body = std::function<void(int64_t begin, int64_t end)>;

  // num_threads counts the calling thread, so 1 means "run inline, no workers".
  explicit ThreadPool(int num_threads) : n_(num_threads < 1 ? 1 : num_threads) {
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_.store(true);
    }
    cv_start_.notify_all();
    for (auto& t : workers_) t.join();
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }

  // Calls body(begin, end) on disjoint chunks covering [0, n); returns when all chunks ran.
  // body must not throw. Concurrent callers are serialized.
  //
  // The caller waits for the chunks, not for the workers: a worker that another process keeps
  // off the CPU simply finds no chunk left when it gets there, so a busy machine degrades to
  // single-threaded speed instead of to a scheduler time slice.
  void parallel_for(int64_t n, int64_t grain, const Body& body) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (n_ == 1 || n <= grain) {
      body(0, n);
      return;
    }
    std::lock_guard<std::mutex> call(call_mu_);
    auto job = std::make_shared<Job>(&body, n, grain);
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_start_.notify_all();
    run(*job);
    auto finished = [&] { return job->done.load(std::memory_order_acquire) == n; };
    if (!spin_until(finished)) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_done_.wait(lk, finished);
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (job_ == job) job_.reset();
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(50);

  // One parallel_for. Late workers may still hold it after the caller returned; they only touch
  // the counters (every chunk is taken by then), never the body.
  struct Job {
    Job(const Body* b, int64_t t, int64_t g) : body(b), total(t), grain(g) {}
    const Body* body;
    const int64_t total, grain;
    std::atomic<int64_t> next{0}, done{0};
  };

  template <typename Pred>
  static bool spin_until(Pred ready) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 0;; ++i) {
      if (ready()) return true;
      if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) return false;
      MO_PAUSE();
    }
  }

  void run(Job& job) {
    for (;;) {
      const int64_t begin = job.next.fetch_add(job.grain, std::memory_order_relaxed);
      if (begin >= job.total) return;
      const int64_t end = begin + job.grain < job.total ? begin + job.grain : job.total;
      (*job.body)(begin, end);
      if (job.done.fetch_add(end - begin, std::memory_order_acq_rel) + (end - begin) == job.total) {
        std::lock_guard<std::mutex> lk(mu_);
        cv_done_.notify_all();
      }
    }
  }

  void worker_loop() {
    uint64_t seen = 0;
    for (;;) {
      auto started = [&] { return stop_.load() || generation_.load(std::memory_order_acquire) != seen; };
      if (!spin_until(started)) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_start_.wait(lk, started);
      }
      if (stop_.load()) return;
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lk(mu_);
        seen = generation_.load(std::memory_order_acquire);
        job = job_;
      }
      if (job) run(*job);
    }
  }

  int n_;
  std::vector<std::thread> workers_;
  std::mutex mu_, call_mu_;
  std::condition_variable cv_start_, cv_done_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::shared_ptr<Job> job_;  // the current job, guarded by mu_
};

}  // namespace mo
