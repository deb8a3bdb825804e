// Preemption as clusters announce it (not public API): SIGTERM and SIGUSR1 ask a run to stop
// gracefully; the step loop reads the request at step boundaries (kiln train's PreemptionHook).
#pragma once

namespace kiln {

/// Installs handlers for SIGTERM and SIGUSR1 (once per process; later calls update the timeout).
/// The first signal records a stop request and, with `timeout_seconds` > 0, arms alarm(2): if the
/// process is still running then, SIGALRM ends it at once (status 142). A SIGTERM that arrives
/// one second or more after the request ends the process at once (status 143): the last
/// committed checkpoint stays intact. Further SIGUSR1s are ignored.
void install_stop_signals(int timeout_seconds);

/// The signal that asked this process to stop (SIGTERM or SIGUSR1), or 0. Async-signal-safe.
int stop_signal();

/// The signal's name ("SIGTERM", "SIGUSR1"), "a signal" for others.
const char* stop_signal_name(int signal);

}  // namespace kiln
