#include "kiln/run.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <sys/utsname.h>
#include <torch/cuda.h>
#include <torch/version.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/files.h"
#include "core/process.h"
#ifdef KILN_WITH_CUDA
#include "core/cuda_info.h"
#endif
#include "kiln/build_info.h"
#include "kiln/error.h"
#include "kiln/log.h"

namespace kiln {
namespace {

using nlohmann::json;

json os_info() {
  struct utsname u {};
  if (::uname(&u) != 0) return "unknown";
  std::string pretty;
  std::ifstream in("/etc/os-release");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("PRETTY_NAME=", 0) == 0) {
      pretty = line.substr(12);
      if (pretty.size() >= 2 && pretty.front() == '"') pretty = pretty.substr(1, pretty.size() - 2);
    }
  }
  return {{"system", u.sysname},
          {"release", u.release},
          {"machine", u.machine},
          {"distribution", pretty.empty() ? json(nullptr) : json(pretty)}};
}

// Lines of at::show_config() that name a library version, e.g. "CUDA Runtime 12.8".
json find_config_line(const std::string& config, const std::string& needle) {
  std::istringstream in(config);
  std::string line;
  while (std::getline(in, line)) {
    size_t at = line.find(needle);
    if (at != std::string::npos) {
      std::string rest = line.substr(at + needle.size());
      if (needle.back() == '=') rest = rest.substr(0, rest.find(','));  // one KEY=value setting
      size_t begin = rest.find_first_not_of(" :");
      return begin == std::string::npos ? json(nullptr) : json(rest.substr(begin));
    }
  }
  return nullptr;
}

const char* env_or_null(const char* name) {
  const char* value = std::getenv(name);
  return value && *value ? value : nullptr;
}

}  // namespace

std::string utc_now_iso8601() {
  std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buffer[32];
  std::strftime(buffer, sizeof(buffer), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buffer;
}

std::filesystem::path run_directory(const Config& config) {
  std::string name = config.get_string("run.name");
  if (name.empty()) name = config.source().empty() ? "run" : config.source().stem().string();
  if (name.find('/') != std::string::npos || name == "." || name == "..") {
    throw UserError("run.name = \"" + name + "\" must be a plain directory name (no '/')");
  }
  return std::filesystem::path(config.get_string("run.dir")) / name;
}

json make_manifest(const Config& config, const std::string& command_line,
                   const std::string& start_time_utc, const json& data, const json& model) {
  const BuildInfo& build = build_info();
  std::string torch_config = at::show_config();
  bool cuda = torch::cuda::is_available();
  const std::string cpu = cpu_model();  // /proc/cpuinfo, read once
#ifdef KILN_WITH_CUDA
  const std::string nccl = nccl_version();
#else
  const std::string nccl;  // a CPU LibTorch has no NCCL
#endif
  json devices = json::array();
  devices.push_back({{"type", "cpu"}, {"name", cpu}});
  if (cuda) {
    for (int k = 0; k < static_cast<int>(torch::cuda::device_count()); ++k) {
#ifdef KILN_WITH_CUDA
      devices.push_back(cuda_device_record(k));
#else
      devices.push_back({{"type", "cuda"}, {"index", k}});
#endif
    }
  }
  const char* digest = env_or_null("KILN_CONTAINER_DIGEST");
  return {
      {"manifest_version", 1},
      {"kiln",
       {{"version", build.version},
        {"git_commit", build.git_commit},
        {"git_dirty", build.git_dirty}}},
      {"build",
       {{"compiler", build.compiler},
        {"build_type", build.build_type},
        {"flags", build.build_flags},
        {"libtorch_dir", build.torch_dir}}},
      {"libtorch",
       {{"version", TORCH_VERSION},
        {"cuda_available", cuda},
        {"cuda_runtime", find_config_line(torch_config, "CUDA Runtime")},
        {"cudnn", find_config_line(torch_config, "CuDNN")},
        {"cuda_build", find_config_line(torch_config, "CUDA_VERSION=")},
        {"cudnn_build", find_config_line(torch_config, "CUDNN_VERSION=")},
        {"nccl", nccl.empty() ? json(nullptr) : json(nccl)},
        {"blas", find_config_line(torch_config, "BLAS_INFO=")}}},
      {"devices", devices},
      {"host",
       {{"hostname", hostname()},
        {"os", os_info()},
        {"cpu_model", cpu},
        {"logical_cpus", std::thread::hardware_concurrency()},
        {"intra_op_threads", at::get_num_threads()},
        {"inter_op_threads", at::get_num_interop_threads()},
        {"omp_num_threads",
         env_or_null("OMP_NUM_THREADS") ? json(env_or_null("OMP_NUM_THREADS")) : json(nullptr)}}},
      {"container_image_digest", digest ? json(digest) : json(nullptr)},
      {"config",
       {{"file", config.source().empty() ? json(nullptr) : json(config.source().string())},
        {"hash_xxh64", config.hash()}}},
      {"seeds", {{"run.seed", config.get_int("run.seed")}, {"data.seed", data_seed(config)}}},
      {"deterministic", config.get_bool("run.deterministic")},
      {"data", data},
      {"model", model},
      {"command_line", command_line},
      {"start_time_utc", start_time_utc},
  };
}

Run::Run(const Config& config, RunOptions options)
    : config_(config), options_(std::move(options)), dir_(run_directory(config)) {
  std::vector<const char*> argv;
  for (const auto& arg : options_.argv) argv.push_back(arg.c_str());
  command_line_ = join_command_line(static_cast<int>(argv.size()), argv.data());
  start_time_utc_ = utc_now_iso8601();
  if (!options_.writer) return;
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) {
    throw UserError("cannot create run directory " + dir_.string() + ": " + ec.message() +
                    "; set run.dir to a writable place");
  }
  write_text("config.toml", config_.to_toml(true));
  log::set_file(dir_ / "train.log");
  const auto metrics_path = dir_ / options_.metrics_file;
  metrics_.open(metrics_path, options_.append_metrics ? std::ios::app : std::ios::trunc);
  if (!metrics_)
    throw UserError("cannot write " + metrics_path.string() + "; check run.dir's permissions");
}

Run::~Run() {
  if (options_.writer) log::close_file();
}

void Run::write_json(std::string_view filename, const json& value) const {
  // Paths and arguments need not be UTF-8 on Linux: invalid bytes become U+FFFD, never an error.
  write_text(filename, value.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
}

void Run::write_text(std::string_view filename, std::string_view text) const {
  if (!options_.writer) return;
  write_file_atomic(dir_ / filename, text);
}

void Run::append_metrics(const json& record) {
  if (!options_.writer) return;
  metrics_ << record.dump(-1, ' ', false, json::error_handler_t::replace) << '\n';
  metrics_.flush();
}

void Run::write_manifest(const json& data, const json& model, const json& extra) const {
  json manifest = make_manifest(config_, command_line_, start_time_utc_, data, model);
  for (auto& [key, value] : extra.items()) manifest[key] = value;
  write_json("manifest.json", manifest);
}

std::map<int64_t, double> read_step_losses(const std::filesystem::path& metrics) {
  std::map<int64_t, double> losses;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_object() && record.contains("loss") && record["loss"].is_number() &&
        record.contains("step") && record["step"].is_number_integer()) {
      losses[record["step"].get<int64_t>()] = record["loss"].get<double>();
    }
  }
  return losses;
}

}  // namespace kiln
