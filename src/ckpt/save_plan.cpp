// Save planning: each rank's account of its request, the check that the ranks' accounts fit
// together, who writes which tensor, and rank 0's draft of the index.
#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <map>
#include <set>

#include "ckpt/saving.h"
#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/run.h"
#include "kiln/safetensors.h"

namespace kiln::ckpt {
namespace {

using nlohmann::json;

std::vector<int64_t> shape_of(const torch::Tensor& t) {
  return {t.sizes().begin(), t.sizes().end()};
}

// Which rank writes each replicated tensor: largest first, each to the rank with the fewest bytes
// so far (sharded bytes included; ties to the lowest rank). Deterministic, so every rank computes
// the same plan from the same list.
std::vector<int> plan_replicated(const std::vector<const StateTensor*>& replicated,
                                 const std::vector<json>& descs) {
  std::vector<uint64_t> load(descs.size());
  for (size_t r = 0; r < descs.size(); ++r) load[r] = descs[r]["sharded_bytes"].get<uint64_t>();
  std::vector<size_t> order(replicated.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const uint64_t ba = replicated[a]->tensor.nbytes(), bb = replicated[b]->tensor.nbytes();
    return ba != bb ? ba > bb : replicated[a]->name < replicated[b]->name;
  });
  std::vector<int> owner(replicated.size());
  for (size_t k : order) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[k] = r;
    load[static_cast<size_t>(r)] += replicated[k]->tensor.nbytes();
  }
  return owner;
}

}  // namespace
json describe_request(const SaveRequest& request, int rank) {
  json desc = {{"step", request.step}, {"error", ""}};
  std::set<std::string> names;
  std::string replicated;  // canonical text of the replicated tensors, hashed
  json sharded = json::array();
  uint64_t sharded_bytes = 0;
  for (const auto& t : request.tensors) {
    if (t.name.empty()) throw UserError("checkpoint: a state tensor has an empty name");
    if (!names.insert(t.stored_name()).second)
      throw UserError("checkpoint: state tensor '" + t.stored_name() + "' is listed twice");
    if (t.part != 0 && t.placement != Placement::kSharded)
      throw UserError("checkpoint: state tensor '" + t.name + "' has parts but is replicated");
    if (!t.tensor.defined())
      throw UserError("checkpoint: state tensor '" + t.name + "' is undefined");
    const std::string dtype = safetensors_dtype(t.tensor.scalar_type());
    if (t.placement == Placement::kReplicated) {
      replicated += t.name + "|" + dtype + "|" + json(shape_of(t.tensor)).dump() + "\n";
      continue;
    }
    const auto sizes = shape_of(t.tensor);
    if (t.global_shape.size() != sizes.size() || t.offsets.size() != sizes.size()) {
      throw UserError("checkpoint: sharded tensor '" + t.name + "' on rank " +
                      std::to_string(rank) +
                      ": global_shape and offsets need one entry per dimension of the piece");
    }
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (t.offsets[d] < 0 || t.offsets[d] + sizes[d] > t.global_shape[d]) {
        throw UserError("checkpoint: sharded tensor '" + t.name + "' on rank " +
                        std::to_string(rank) + ": the piece at offsets " + json(t.offsets).dump() +
                        " with shape " + json(sizes).dump() + " does not fit in the global shape " +
                        json(t.global_shape).dump());
      }
    }
    sharded.push_back({{"name", t.name},
                       {"stored", t.stored_name()},
                       {"dtype", dtype},
                       {"shape", t.global_shape},
                       {"offsets", t.offsets},
                       {"sizes", sizes}});
    sharded_bytes += t.tensor.nbytes();
  }
  desc["replicated_xxh3"] = hex64(XXH3_64bits(replicated.data(), replicated.size()));
  desc["sharded"] = std::move(sharded);
  desc["sharded_bytes"] = sharded_bytes;
  desc["rank_state"] = request.rank_state.is_null() ? json::object() : request.rank_state;
  return desc;
}

std::string check_descriptions(const std::vector<json>& descs) {
  for (size_t r = 0; r < descs.size(); ++r) {
    if (!descs[r]["error"].get<std::string>().empty()) {
      return "rank " + std::to_string(r) + ": " + descs[r]["error"].get<std::string>();
    }
  }
  for (size_t r = 1; r < descs.size(); ++r) {
    if (descs[r]["step"] != descs[0]["step"]) {
      return fmt::format(
          "checkpoint: rank {} saves step {} but rank 0 saves step {}; every rank must save the "
          "same step",
          r, descs[r]["step"].dump(), descs[0]["step"].dump());
    }
    if (descs[r]["replicated_xxh3"] != descs[0]["replicated_xxh3"]) {
      return fmt::format(
          "checkpoint: rank {} lists other replicated tensors (names, dtypes or shapes) than rank "
          "0",
          r);
    }
  }
  struct Piece {
    std::vector<int64_t> offsets, sizes;
  };
  std::map<std::string, std::pair<json, std::vector<Piece>>> sharded;
  for (const auto& desc : descs) {
    for (const auto& s : desc["sharded"]) {
      auto& [meta, pieces] = sharded[s["name"].get<std::string>()];
      if (meta.is_null()) meta = {{"dtype", s["dtype"]}, {"shape", s["shape"]}};
      if (meta["dtype"] != s["dtype"] || meta["shape"] != s["shape"]) {
        return "checkpoint: the pieces of sharded tensor '" + s["name"].get<std::string>() +
               "' disagree on dtype or global shape across ranks";
      }
      pieces.push_back(
          {s["offsets"].get<std::vector<int64_t>>(), s["sizes"].get<std::vector<int64_t>>()});
    }
  }
  for (const auto& [name, entry] : sharded) {
    const auto& [meta, pieces] = entry;
    uint64_t covered = 0;
    for (size_t a = 0; a < pieces.size(); ++a) {
      const uint64_t volume = ckpt::element_count(pieces[a].sizes);
      covered += volume;
      for (size_t b = 0; b < a && volume > 0; ++b) {
        bool overlap = ckpt::element_count(pieces[b].sizes) > 0;
        for (size_t d = 0; d < pieces[a].sizes.size() && overlap; ++d) {
          overlap = pieces[a].offsets[d] < pieces[b].offsets[d] + pieces[b].sizes[d] &&
                    pieces[b].offsets[d] < pieces[a].offsets[d] + pieces[a].sizes[d];
        }
        if (overlap) return "checkpoint: two pieces of sharded tensor '" + name + "' overlap";
      }
    }
    if (covered != ckpt::element_count(meta["shape"].get<std::vector<int64_t>>())) {
      return "checkpoint: the pieces of sharded tensor '" + name +
             "' do not cover the whole tensor";
    }
  }
  return "";
}

SavePlan plan_save(const SaveRequest& request, const std::vector<json>& descs, int rank) {
  SavePlan plan;
  for (const auto& t : request.tensors) {
    if (t.placement == Placement::kReplicated) plan.replicated.push_back(&t);
  }
  std::sort(plan.replicated.begin(), plan.replicated.end(),
            [](auto* a, auto* b) { return a->name < b->name; });
  plan.owner = plan_replicated(plan.replicated, descs);
  for (const auto& t : request.tensors) {
    if (t.placement == Placement::kSharded) plan.to_write.push_back(&t);
  }
  for (size_t k = 0; k < plan.replicated.size(); ++k) {
    if (plan.owner[k] == rank) plan.to_write.push_back(plan.replicated[k]);
  }
  return plan;
}

json draft_index(const SaveRequest& request, const SavePlan& plan, const std::vector<json>& descs) {
  json tensors = json::object();
  for (size_t k = 0; k < plan.replicated.size(); ++k) {
    const auto& t = *plan.replicated[k];
    const auto shape = shape_of(t.tensor);
    tensors[t.name] = {{"dtype", safetensors_dtype(t.tensor.scalar_type())},
                       {"shape", shape},
                       {"placement", "replicated"},
                       {"chunks", json::array({{{"file", rank_file_name(plan.owner[k])},
                                                {"name", t.name},
                                                {"offsets", std::vector<int64_t>(shape.size(), 0)},
                                                {"sizes", shape}}})}};
  }
  for (size_t r = 0; r < descs.size(); ++r) {
    for (const auto& s : descs[r]["sharded"]) {
      json& entry = tensors[s["name"].get<std::string>()];
      if (entry.is_null()) {
        entry = {{"dtype", s["dtype"]},
                 {"shape", s["shape"]},
                 {"placement", "sharded"},
                 {"chunks", json::array()}};
      }
      entry["chunks"].push_back({{"file", rank_file_name(static_cast<int>(r))},
                                 {"name", s["stored"]},
                                 {"offsets", s["offsets"]},
                                 {"sizes", s["sizes"]}});
    }
  }
  json ranks = json::array();
  for (const auto& d : descs) ranks.push_back(d["rank_state"]);
  return {{"format", kFormatName},
          {"format_version", kCheckpointFormatVersion},
          {"step", request.step},
          {"world_size", static_cast<int>(descs.size())},
          {"created_utc", utc_now_iso8601()},
          {"tensors", std::move(tensors)},
          {"training_state",
           request.training_state.is_null() ? json::object() : request.training_state},
          {"ranks", std::move(ranks)}};
}

}  // namespace kiln::ckpt
