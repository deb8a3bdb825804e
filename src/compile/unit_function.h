// The autograd function a compiled unit (or root piece) runs in: its forward package inside
// forward(), its backward package inside backward(), the saved tensors routed between them
// (src/compile/compiled_units.cpp builds and loads the pairs). Internal to the compile component.
#pragma once

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <memory>
#include <vector>

namespace kiln::compiled_units_impl {

// The package pair of one unit structure (or root piece) and input signature.
struct UnitPair {
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> forward, backward;
  // Each saved tensor the backward takes, in order: an argument of the piece (its input, the
  // targets of the root piece after the units, then its parameters) or an output of the forward
  // package (0 is the piece's output).
  struct Saved {
    bool argument = false;
    size_t index = 0;
  };
  std::vector<Saved> saved;
  std::vector<size_t> gradients;  // backward output k is the gradient of argument gradients[k]
  size_t forward_outputs = 1;
  bool eager = false;  // graph breaks, compile.fullgraph = false
};

// The pair's forward package on `arguments` (the piece's `leading` inputs, then its
// parameters), autocast off (its policy is in the graph); every output, the piece's first.
std::vector<torch::Tensor> run_forward(const UnitPair& pair, at::TensorList arguments,
                                       size_t leading);

struct PairHolder : torch::CustomClassHolder {
  const UnitPair* pair = nullptr;
};

class CompiledUnitFunction : public torch::autograd::Function<CompiledUnitFunction> {
 public:
  // `arguments`: the piece's `leading` inputs (a unit's input; token ids; hidden and targets),
  // then its parameters. Integer arguments get no gradient.
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               c10::intrusive_ptr<PairHolder> holder, at::TensorList arguments,
                               int64_t leading);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

}  // namespace kiln::compiled_units_impl
