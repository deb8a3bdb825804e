#include "kiln/peer.h"

#include "cli/commands.h"

namespace kiln::cli {

namespace {

void add_peer_command(CLI::App& app, Action& action) {
  auto* group =
      app.add_subcommand("peer", "export runs for a peer implementation to replay (bench/peer)");
  group->require_subcommand(1);
  auto* exp = group->add_subcommand(
      "export", "train N steps; write init weights, batches and per-step losses");
  auto args = std::make_shared<ConfigArgs>();
  args->add_to(*exp);
  auto steps = std::make_shared<int64_t>(20);
  auto out = std::make_shared<std::string>();
  exp->add_option("--steps", *steps, "optimizer steps to run and export")
      ->check(CLI::PositiveNumber);
  exp->add_option("--out", *out, "output directory")->required();
  auto initial_loss_scale = std::make_shared<double>(0);
  exp->add_option("--initial-loss-scale", *initial_loss_scale,
                  "fp16-mixed: start the loss scaler at this scale (default 65536)")
      ->check(CLI::PositiveNumber);
  exp->callback([&action, args, steps, out, initial_loss_scale] {
    action = [args, steps, out, initial_loss_scale] {
      export_for_peer(args->load(), *steps, *out, *initial_loss_scale);
      return 0;
    };
  });
}

const Registration peer_registration{95, add_peer_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
