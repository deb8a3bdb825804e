// The only file that includes c10d's ProcessGroupGloo.hpp, and through it Gloo's headers.
//
// The torch wheel ships no Gloo headers; they come from Debian's libgloo-dev, an older Gloo than
// the one compiled into libtorch_cpu. That is safe because this file only (a) calls functions
// compiled into libtorch (Options::create_default, the ProcessGroupGloo constructor) and
// (b) allocates a ProcessGroupGloo, whose members hold Gloo types only through pointers
// (std::shared_ptr<gloo::Context>, ...), so its size and layout do not depend on Gloo's headers.
// It calls no inline Gloo function and instantiates no Gloo class; the test
// dist.gloo_object_defines_no_gloo_symbols checks the compiled object for that. docs/scale.md,
// "Gloo headers", has the whole argument and the alternative.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "dist/backends.h"

#ifndef USE_C10D_GLOO
#error "kiln needs a LibTorch built with Gloo (USE_C10D_GLOO): every Linux torch wheel has it"
#endif

namespace kiln::dist {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  // As torch.distributed does for backend="gloo": the default device list (GLOO_SOCKET_IFNAME,
  // else the address this host's name resolves to, else loopback) and two worker threads per
  // device, so two bucket all-reduces can be in flight at once.
  auto options = c10d::ProcessGroupGloo::Options::create_default(timeout);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

}  // namespace kiln::dist
