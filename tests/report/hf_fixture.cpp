// kiln's forward for the Hugging Face interop test (hf_interop.py): the trained model of a run,
// restored from the run's newest checkpoint, on the tokens the test gives.
//   kiln_hf_fixture <run dir> <tokens.safetensors (input_ids)> <out.safetensors (logits)>
#include <iostream>

#include "kiln/checkpoint.h"
#include "kiln/comm.h"
#include "kiln/config.h"
#include "kiln/models.h"
#include "kiln/safetensors.h"

int main(int argc, char** argv) {
  using namespace kiln;
  if (argc != 4) {
    std::cerr << "usage: kiln_hf_fixture <run dir> <tokens.safetensors> <out.safetensors>\n";
    return 2;
  }
  try {
    const std::filesystem::path run_dir = argv[1];
    const Config config = Config::load(run_dir / "config.toml");
    auto model = make_model(config);
    std::vector<StateTensor> targets;
    for (const auto& item : model->named_parameters()) {
      targets.emplace_back("model/" + item.key(), item.value());
    }
    torch::NoGradGuard no_grad;
    load_checkpoint(resolve_checkpoint_path(checkpoint_options(config, run_dir).dir), targets,
                    *single_process_communicator());
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
