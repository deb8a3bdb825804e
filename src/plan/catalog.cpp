// The hardware catalog: configs/hardware.toml (docs/plan.md, "Hardware catalog").
#include <fmt/format.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cctype>

#include "core/strings.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/plan.h"
#include "plan/options.h"

#ifndef KILN_HARDWARE_CATALOG
#define KILN_HARDWARE_CATALOG ""
#endif
#ifndef KILN_HARDWARE_CATALOG_INSTALLED
#define KILN_HARDWARE_CATALOG_INSTALLED ""
#endif

namespace kiln {
namespace {

std::string lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

std::string upper(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  return out;
}

double number(const toml::table& row, std::string_view key, const std::string& where,
              bool required = true) {
  const auto* node = row.get(key);
  if (node == nullptr) {
    if (!required) return 0;
    throw UserError(
        fmt::format("{}: missing {}; every row needs it (see configs/hardware.toml)", where, key));
  }
  if (auto v = node->value<double>()) return *v;
  throw UserError(fmt::format("{}: {} must be a number", where, key));
}

std::string text(const toml::table& row, std::string_view key, const std::string& where) {
  const auto* node = row.get(key);
  if (node == nullptr || !node->is_string()) {
    throw UserError(fmt::format("{}: missing {} (a string); every figure needs its source and date",
                                where, key));
  }
  return std::string(*node->value<std::string_view>());
}

std::vector<Device> read_rows(const std::filesystem::path& file) {
  toml::table doc;
  try {
    doc = toml::parse_file(file.string());
  } catch (const toml::parse_error& e) {
    throw UserError(fmt::format("{}:{}: {}", file.string(), e.source().begin.line,
                                std::string(e.description())));
  }
  const toml::table* devices = doc["device"].as_table();
  if (devices == nullptr) {
    throw UserError(
        fmt::format("{}: no [device.<name>] tables; see configs/hardware.toml", file.string()));
  }
  // toml++ keeps a table's keys sorted; rows keep the file's order (the order plans print).
  std::vector<std::pair<std::string, const toml::node*>> in_file_order;
  for (const auto& [key, node] : *devices) in_file_order.emplace_back(key.str(), &node);
  std::stable_sort(in_file_order.begin(), in_file_order.end(), [](const auto& a, const auto& b) {
    return a.second->source().begin.line < b.second->source().begin.line;
  });
  std::vector<Device> out;
  for (const auto& [key_text, node_ptr] : in_file_order) {
    const toml::node& node = *node_ptr;
    const std::string where = fmt::format("{}: [device.{}]", file.string(), key_text);
    const toml::table* row = node.as_table();
    if (row == nullptr) throw UserError(where + " is not a table");
    Device d;
    d.name = lower(key_text);
    d.display_name = row->contains("display_name") ? text(*row, "display_name", where) : d.name;
    d.memory_bytes = number(*row, "memory_gb", where) * 1e9;
    d.memory_bandwidth_bytes_per_second = number(*row, "memory_bandwidth_gb_per_s", where) * 1e9;
    d.interconnect = row->contains("interconnect") ? text(*row, "interconnect", where) : "";
    d.interconnect_bytes_per_second = number(*row, "interconnect_gb_per_s", where) * 1e9;
    d.gpus_per_node = static_cast<int64_t>(number(*row, "gpus_per_node", where, false));
    if (d.gpus_per_node <= 0) d.gpus_per_node = 8;
    d.network_bytes_per_second = number(*row, "network_gb_per_s", where) * 1e9;
    const toml::table* peaks = row->get_as<toml::table>("peak_tflops");
    if (peaks == nullptr) throw UserError(where + ": missing peak_tflops = { bf16 = ..., ... }");
    for (const auto& [precision, value] : *peaks) {
      auto v = value.value<double>();
      if (!v || *v <= 0)
        throw UserError(
            fmt::format("{}: peak_tflops.{} must be a positive number", where, precision.str()));
      d.peak_flops[lower(precision.str())] = *v * 1e12;
    }
    d.source = text(*row, "source", where);
    d.date = text(*row, "date", where);
    for (const auto& [key, value] :
         {std::pair{"memory_gb", d.memory_bytes},
          std::pair{"memory_bandwidth_gb_per_s", d.memory_bandwidth_bytes_per_second},
          std::pair{"interconnect_gb_per_s", d.interconnect_bytes_per_second},
          std::pair{"network_gb_per_s", d.network_bytes_per_second}}) {
      if (!(value > 0)) throw UserError(fmt::format("{}: {} must be positive", where, key));
    }
    if (row->contains("host_memory_gb")) {
      d.host_memory_bytes = number(*row, "host_memory_gb", where) * 1e9;
      if (!(d.host_memory_bytes > 0))
        throw UserError(fmt::format("{}: host_memory_gb must be positive", where));
      d.host_memory_source = text(*row, "host_memory_source", where);
    }
    if (const toml::array* match = row->get_as<toml::array>("match")) {
      for (const auto& m : *match) {
        if (auto s = m.value<std::string>()) d.match.push_back(upper(*s));
      }
    }
    out.push_back(std::move(d));
  }
  return out;
}

std::filesystem::path builtin_catalog() {
  for (const char* candidate : {KILN_HARDWARE_CATALOG, KILN_HARDWARE_CATALOG_INSTALLED}) {
    std::error_code ec;
    if (*candidate != '\0' && std::filesystem::exists(candidate, ec)) return candidate;
  }
  throw UserError(fmt::format(
      "the hardware catalog is missing (looked for {} and {}); reinstall kiln or set plan.catalog",
      KILN_HARDWARE_CATALOG, KILN_HARDWARE_CATALOG_INSTALLED));
}

std::vector<Device> load_devices(const std::filesystem::path& extra_file) {
  std::vector<Device> rows = read_rows(builtin_catalog());
  if (!extra_file.empty()) {
    std::error_code ec;
    if (!std::filesystem::exists(extra_file, ec)) {
      throw UserError(fmt::format("plan.catalog = \"{}\": no such file", extra_file.string()));
    }
    for (auto& extra : read_rows(extra_file)) {
      auto same = std::find_if(rows.begin(), rows.end(),
                               [&](const Device& d) { return d.name == extra.name; });
      if (same != rows.end()) {
        *same = std::move(extra);
      } else {
        rows.push_back(std::move(extra));
      }
    }
  }
  return rows;
}

}  // namespace

std::string compute_precision(std::string_view precision) {
  std::string p = lower(precision);
  constexpr std::string_view mixed = "-mixed";  // bf16-mixed computes in bf16 (train.precision)
  if (p.size() > mixed.size() && p.ends_with(mixed)) p.resize(p.size() - mixed.size());
  return p;
}

double Device::peak_flops_for(std::string_view precision) const {
  auto it = peak_flops.find(compute_precision(precision));
  return it == peak_flops.end() ? 0.0 : it->second;
}

std::vector<Device> load_catalog(const std::filesystem::path& extra_file) {
  return load_devices(extra_file);
}

const Device& find_device(const std::vector<Device>& catalog, std::string_view name,
                          std::string_view key) {
  const std::string wanted = lower(trim(name));
  for (const auto& d : catalog) {
    if (d.name == wanted) return d;
  }
  // The closest: a row whose name starts with the text or whose match words (the runtime names,
  // "H100") the text contains, when exactly one does; else the nearest name by edit distance.
  std::vector<std::string> named;
  for (const auto& d : catalog) {
    bool hit = !wanted.empty() && d.name.starts_with(wanted);
    for (const auto& word : d.match) {
      if (!word.empty() && upper(wanted).find(word) != std::string::npos) hit = true;
    }
    if (hit) named.push_back(d.name);
  }
  std::string closest;
  if (named.size() == 1) {
    closest = named.front();
  } else {
    size_t best = std::string::npos;
    for (const auto& d : catalog) {
      const size_t distance = edit_distance(wanted, d.name);
      if (distance < best) best = distance, closest = d.name;
    }
  }
  std::string known;
  for (const auto& d : catalog) known += (known.empty() ? "" : ", ") + d.name;
  throw UserError(
      fmt::format("{}: unknown hardware \"{}\"{}; the catalog has {} (add rows with plan.catalog)",
                  key, std::string(name),
                  closest.empty() ? "" : fmt::format(" (did you mean \"{}\"?)", closest), known));
}

const Device* device_for_name(const std::vector<Device>& catalog, std::string_view device_name) {
  const std::string name = upper(device_name);
  for (const auto& d : catalog) {
    for (const auto& word : d.match) {
      if (!word.empty() && name.find(word) != std::string::npos) return &d;
    }
  }
  return nullptr;
}

double catalog_peak_flops(const Config& config, std::string_view device_name,
                          std::string_view precision) {
  const auto catalog = load_catalog(PlanInputs::from_config(config).plan_catalog);
  const Device* device = device_for_name(catalog, device_name);
  return device != nullptr ? device->peak_flops_for(precision) : 0.0;
}

std::optional<Device> catalog_device(const Config& config, std::string_view device_name) {
  const auto catalog = load_catalog(PlanInputs::from_config(config).plan_catalog);
  const Device* device = device_for_name(catalog, device_name);
  if (device == nullptr) return std::nullopt;
  return *device;
}

void set_links(StrategyInput& input, const Device& device) {
  input.gpus_per_node = device.gpus_per_node;
  input.intra_node_bytes_per_second = device.interconnect_bytes_per_second / 2.0;
  input.inter_node_bytes_per_second = device.network_bytes_per_second;
}

std::string manifest_device_name(const nlohmann::json& manifest, int cuda_index) {
  if (cuda_index < 0) return "cpu";
  if (manifest.is_object() && manifest.contains("devices")) {
    for (const auto& d : manifest["devices"]) {
      if (d.value("type", "") == "cuda" && d.value("index", -1) == cuda_index && d.contains("name"))
        return d["name"].get<std::string>();
    }
  }
  return fmt::format("cuda:{}", cuda_index);
}

}  // namespace kiln
