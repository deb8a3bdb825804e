// The process-wide settings a run applies (src/train/runtime.cpp): run.keep_freed_memory.
#include <gtest/gtest.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

#include "kiln/train.h"

namespace kiln::testing {
namespace {

// glibc's malloc (AddressSanitizer's allocator replaces it, and kiln leaves that alone).
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__)
// Minor page faults over `rounds` steps that each allocate 64 MiB (a large activation or
// gradient), touch every page and free it again.
long faults_over(int rounds) {
  constexpr size_t kBytes = size_t{64} << 20;
  rusage before{}, after{};
  getrusage(RUSAGE_SELF, &before);
  for (int r = 0; r < rounds; ++r) {
    void* p = nullptr;
    if (posix_memalign(&p, 64, kBytes) != 0) return -1;
    // One write per 4 KiB page, through volatile so no store is elided before the free.
    volatile char* bytes = static_cast<volatile char*>(p);
    for (size_t i = 0; i < kBytes; i += 4096) bytes[i] = static_cast<char>(r + 1);
    std::free(p);
  }
  getrusage(RUSAGE_SELF, &after);
  return after.ru_minflt - before.ru_minflt;
}

// In a child process (mallopt is process-wide): glibc's own defaults first, the control, where
// each round maps its 64 MiB afresh; then run.keep_freed_memory, after which the rounds reuse
// the heap. The child sends both counts back through a pipe.
TEST(RuntimeSettings, KeepFreedMemoryReusesTheHeapInsteadOfMappingEachStepAfresh) {
  for (const bool keep : {true, false}) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(fds[0]);
      // glibc's defaults, whatever this test process was set to before the fork.
      mallopt(M_MMAP_MAX, 65536);
      mallopt(M_MMAP_THRESHOLD, 128 * 1024);
      mallopt(M_TRIM_THRESHOLD, 128 * 1024);
      long counts[2];
      counts[0] = faults_over(4);
      RuntimeOptions options;
      options.deterministic = false;
      options.keep_freed_memory = keep;
      apply_runtime_settings(options);
      // The heap settles: glibc's aligned allocation (c10's posix_memalign) finds a freed chunk
      // a few bytes short at first and grows the heap a few times before it reuses one.
      faults_over(16);
      counts[1] = faults_over(4);
      const bool sent = write(fds[1], counts, sizeof counts) == sizeof counts;
      _exit(sent ? 0 : 1);
    }
    close(fds[1]);
    long counts[2] = {-1, -1};
    const bool read_all = read(fds[0], counts, sizeof counts) == sizeof counts;
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_TRUE(read_all && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    const long defaults = counts[0], after = counts[1];
    // Every round of the control faults its pages in again (4 KiB or 2 MiB pages alike).
    EXPECT_GE(defaults, 4 * 16) << "keep = " << keep;
    if (keep) {
      EXPECT_LT(after * 4, defaults) << "run.keep_freed_memory = true: " << after
                                     << " faults in 4 rounds, " << defaults << " with defaults";
    } else {
      EXPECT_GE(after * 2, defaults)
          << "run.keep_freed_memory = false changed glibc's behaviour: " << after
          << " faults against " << defaults;
    }
  }
}
#endif

}  // namespace
}  // namespace kiln::testing
