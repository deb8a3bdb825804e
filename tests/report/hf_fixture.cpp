// kiln's forward for the Hugging Face interop test (interop_test.py), on the tokens the test gives:
// the trained model of a run, restored from the run's newest checkpoint; or the model a config
// builds (with model.init_from: the Hugging Face directory's weights).
//   kiln_hf_fixture <run dir | config.toml> <tokens.safetensors (input_ids)> <out.safetensors>
#include <iostream>

#include "kiln/checkpoint.h"
#include "kiln/comm.h"
#include "kiln/config.h"
#include "kiln/models.h"
#include "kiln/safetensors.h"

int main(int argc, char** argv) {
  using namespace kiln;
  if (argc != 4) {
    std::cerr << "usage: kiln_hf_fixture <run dir | config.toml> <tokens.safetensors> "
                 "<out.safetensors>\n";
    return 2;
  }
  try {
    const std::filesystem::path source = argv[1];
    const bool run = std::filesystem::is_directory(source);
    const Config config = Config::load(run ? source / "config.toml" : source);
    auto model = make_model(config);
    torch::NoGradGuard no_grad;
    if (run) {
      std::vector<StateTensor> targets;
      for (const auto& item : model->named_parameters()) {
        targets.emplace_back("model/" + item.key(), item.value());
      }
      load_checkpoint(resolve_checkpoint_path(checkpoint_options(config, source).dir), targets,
                      *single_process_communicator());
    }
    model->eval();
    torch::Tensor tokens;
    for (auto& [name, tensor] : read_safetensors(argv[2])) {
      if (name == "input_ids") tokens = tensor;
    }
    const std::vector<std::pair<std::string, torch::Tensor>> out = {
        {"logits", model->forward(tokens)}};
    write_safetensors(argv[3], out);
  } catch (const std::exception& e) {
    std::cerr << "kiln_hf_fixture: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
