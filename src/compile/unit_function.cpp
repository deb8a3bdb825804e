// The compiled unit's autograd function (src/compile/unit_function.h).
#include "compile/unit_function.h"

#include <ATen/autocast_mode.h>
#include <fmt/format.h>

#include <stdexcept>

namespace kiln::compiled_units_impl {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// Autocast would re-cast inside the packages' ATen fallbacks: the autocast policy is already in
// the graphs, so it is off while a package runs.
struct NoAutocastInPackage {
  c10::impl::ExcludeDispatchKeyGuard guard{
      c10::DispatchKeySet({c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA})};
};

}  // namespace

std::vector<torch::Tensor> run_forward(const UnitPair& pair, at::TensorList arguments,
                                       size_t leading) {
  std::vector<torch::Tensor> args;
  args.reserve(arguments.size());
  for (size_t k = 0; k < arguments.size(); ++k) {
    args.push_back(k < leading ? arguments[k].contiguous() : arguments[k]);
  }
  NoAutocastInPackage no_autocast;
  std::vector<torch::Tensor> outs = pair.forward->run(args);
  if (outs.size() != pair.forward_outputs) {
    throw std::logic_error(fmt::format("a unit's forward package returned {} tensors, not {}",
                                       outs.size(), pair.forward_outputs));
  }
  return outs;
}

torch::Tensor CompiledUnitFunction::forward(AutogradContext* ctx,
                                            c10::intrusive_ptr<PairHolder> holder,
                                            at::TensorList arguments, int64_t leading) {
  const UnitPair& pair = *holder->pair;
  std::vector<torch::Tensor> outs = run_forward(pair, arguments, static_cast<size_t>(leading));
  variable_list saved;
  saved.reserve(pair.saved.size());
  for (const UnitPair::Saved& s : pair.saved) {
    saved.push_back(s.argument ? arguments[s.index] : outs[s.index]);
  }
  ctx->save_for_backward(saved);
  ctx->saved_data["pair"] = c10::IValue::make_capsule(holder);
  ctx->saved_data["arguments"] = static_cast<int64_t>(arguments.size());
  return outs[0];
}

variable_list CompiledUnitFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  auto holder = c10::static_intrusive_pointer_cast<PairHolder>(ctx->saved_data["pair"].toCapsule());
  const UnitPair& pair = *holder->pair;
  std::vector<torch::Tensor> args = ctx->get_saved_variables();
  torch::Tensor grad = grad_outputs[0];
  args.push_back(grad.contiguous());
  std::vector<torch::Tensor> grads;
  {
    NoAutocastInPackage no_autocast;
    grads = pair.backward->run(args);
  }
  const auto arguments = static_cast<size_t>(ctx->saved_data["arguments"].toInt());
  // One per forward input: [0] the pair capsule, [1 + k] argument k, last `leading`.
  variable_list out(2 + arguments);
  for (size_t k = 0; k < grads.size() && k < pair.gradients.size(); ++k) {
    out[1 + pair.gradients[k]] = grads[k];
  }
  return out;
}

}  // namespace kiln::compiled_units_impl
