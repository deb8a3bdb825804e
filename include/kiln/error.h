// Error types. Every error a user can act on is a UserError whose message is one line naming
// the file, key, rank or step and the fix; the CLI prints it and exits with status 2.
#pragma once

#include <stdexcept>
#include <string>

namespace kiln {

/// Bad input: config, flags, data files, checkpoints. Exit status 2.
class UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A training run stopped on a guard: non-finite loss or gradient, a failed rung gate.
/// Exit status 3. The message names the step and what to change.
class TrainingError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The run stopped early because it was asked to (SIGTERM or SIGUSR1: preemption) after every
/// rank finished its step and a checkpoint was committed; `--resume auto` continues it.
/// Exit status 75 (kExitPreempted).
class Preempted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// CLI exit statuses.
inline constexpr int kExitOk = 0;
inline constexpr int kExitInternal = 1;
inline constexpr int kExitUserError = 2;
inline constexpr int kExitGateFailed = 3;
/// Preempted: stopped on SIGTERM/SIGUSR1 with a checkpoint committed; requeue and resume. (75 is
/// EX_TEMPFAIL of sysexits.h: "try again later".)
inline constexpr int kExitPreempted = 75;

}  // namespace kiln
