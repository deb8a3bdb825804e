// A program outside kiln's tree that trains through an installed kiln (find_package(kiln)): it
// builds a config, opens a session (run directory, model, data, Trainer) and runs 40 steps of the
// seed MLP on synthetic data, then checks the loss fell. Exit 0 only when it did.
#include <kiln/config.h>
#include <kiln/session.h>
#include <kiln/train.h>

#include <cstdio>
#include <exception>
#include <numeric>
#include <string>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer RUN_DIR\n");
    return 2;
  }
  try {
    kiln::Config config = kiln::Config::parse(
        "[model]\nname = \"mlp\"\n[data]\nname = \"synthetic\"\n[train]\nsteps = 40\n"
        "eval_every = 0\n[optim]\nlr = 3e-3\n[run]\nname = \"consumer\"\nprogress = \"off\"\n",
        "consumer");
    config.set_from_string(std::string("run.dir=") + argv[1]);
    config.validate();
    auto session = kiln::open_session(config, {.argv = {"consumer"}});
    auto log = std::make_shared<kiln::StepLog>();
    session->trainer->add_hook(log);
    session->trainer->run_steps(40);
    std::vector<double> losses;
    for (const auto& step : log->steps)
      if (step.synced) losses.push_back(step.loss);
    if (losses.size() != 40) {
      std::fprintf(stderr, "consumer: %zu losses recorded, expected 40\n", losses.size());
      return 1;
    }
    const double first = std::accumulate(losses.begin(), losses.begin() + 5, 0.0) / 5;
    const double last = std::accumulate(losses.end() - 5, losses.end(), 0.0) / 5;
    std::printf("consumer: trained %zu steps, loss %.4f -> %.4f\n", losses.size(), first, last);
    return last < 0.9 * first ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
