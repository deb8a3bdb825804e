#include "kiln/run.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/utsname.h>
#include <torch/cuda.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "core/files.h"
#include "core/options.h"
#include "core/pins.h"
#include "core/process.h"
#include "core/records.h"
#include "core/strings.h"
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

// A metrics file whose last line has no newline holds a record torn by a kill: cut it off.
void repair_torn_last_line(const std::filesystem::path& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  if (!fd.valid()) return;  // no file yet: nothing to repair
  const off_t size = ::lseek(fd.get(), 0, SEEK_END);
  if (size <= 0) return;
  // Scan back for the last newline, a block at a time.
  std::vector<char> block(1 << 16);
  off_t end = size, keep = 0;
  bool last_is_newline = false, found = false;
  while (end > 0 && !found) {
    const off_t begin =
        end > static_cast<off_t>(block.size()) ? end - static_cast<off_t>(block.size()) : 0;
    const ssize_t n = ::pread(fd.get(), block.data(), static_cast<size_t>(end - begin), begin);
    if (n != end - begin) {
      throw UserError("cannot read " + path.string() + ": " + errno_text() +
                      "; check run.dir's permissions");
    }
    if (end == size && block[static_cast<size_t>(n - 1)] == '\n') last_is_newline = true;
    if (last_is_newline) return;
    for (ssize_t k = n - 1; k >= 0; --k) {
      if (block[static_cast<size_t>(k)] == '\n') {
        keep = begin + k + 1;
        found = true;
        break;
      }
    }
    end = begin;
  }
  if (::ftruncate(fd.get(), keep) != 0) {
    throw UserError("cannot repair " + path.string() + " (its last line is torn): " + errno_text() +
                    "; remove that line by hand");
  }
  log::warn(fmt::format(
      "{}: removed a torn last line ({} bytes without a newline, left by a run that was "
      "killed mid-write) before appending",
      path.string(), static_cast<int64_t>(size - keep)));
}

const char* env_or_null(const char* name) {
  const char* value = std::getenv(name);
  return value && *value ? value : nullptr;
}

// Where the container image digest comes from: KILN_CONTAINER_DIGEST, else what the runtime
// exposes inside the container (podman's /run/.containerenv names the image and its id; docker's
// /.dockerenv and a container cgroup only say "a container"), else not in a container.
json container_pin() {
  if (const char* digest = env_or_null("KILN_CONTAINER_DIGEST")) {
    return {{"digest", digest}, {"digest_source", "KILN_CONTAINER_DIGEST"}};
  }
  std::ifstream podman("/run/.containerenv");
  if (podman) {
    std::string line, image, id;
    while (std::getline(podman, line)) {
      if (line.rfind("image=", 0) == 0) image = line.substr(6);
      if (line.rfind("imageid=", 0) == 0) id = line.substr(8);
    }
    auto unquote = [](std::string v) {
      return v.size() >= 2 && v.front() == '"' ? v.substr(1, v.size() - 2) : v;
    };
    if (!id.empty()) {
      return {{"digest", unquote(id)},
              {"image", unquote(image)},
              {"digest_source", "/run/.containerenv (podman image id)"}};
    }
    return {{"digest", nullptr},
            {"digest_source",
             "in a podman container without an image id in /run/.containerenv; "
             "set KILN_CONTAINER_DIGEST"}};
  }
  std::error_code ec;
  bool docker = std::filesystem::exists("/.dockerenv", ec);
  std::ifstream cgroup("/proc/1/cgroup");
  std::string line;
  while (!docker && std::getline(cgroup, line)) {
    docker = line.find("docker") != std::string::npos ||
             line.find("kubepods") != std::string::npos ||
             line.find("containerd") != std::string::npos;
  }
  if (docker) {
    return {{"digest", nullptr},
            {"digest_source",
             "in a container whose runtime exposes no image digest inside it "
             "(/.dockerenv or the cgroup); set KILN_CONTAINER_DIGEST"}};
  }
  return {{"digest", nullptr}, {"digest_source", "not in a container"}};
}

// stdout of a shell command, or nullopt when it cannot run or exits non-zero.
std::optional<std::string> command_output(const std::string& command) {
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  std::string out;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.append(buffer, n);
  const int status = ::pclose(pipe);
  if (status != 0) return std::nullopt;
  return out;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(line);
  }
  return out;
}

void collect_differences(const json& pinned, const json& current, const std::string& path,
                         std::vector<std::string>& out) {
  if (pinned.is_object() && current.is_object()) {
    for (const auto& [key, value] : pinned.items()) {
      const std::string child = path.empty() ? key : path + "." + key;
      if (!current.contains(key)) {
        out.push_back(fmt::format("{}: {} -> (absent)", child, value.dump()));
      } else {
        collect_differences(value, current[key], child, out);
      }
    }
    for (const auto& [key, value] : current.items()) {
      if (!pinned.contains(key)) {
        out.push_back(
            fmt::format("{}: (absent) -> {}", path.empty() ? key : path + "." + key, value.dump()));
      }
    }
    return;
  }
  if (pinned.is_array() && current.is_array() && pinned.size() > 8 &&
      pinned.front().is_string()) {  // package lists: name the lines that differ
    std::set<std::string> a, b;
    for (const auto& v : pinned) a.insert(v.dump());
    for (const auto& v : current) b.insert(v.dump());
    for (const auto& v : a) {
      if (!b.count(v)) out.push_back(fmt::format("{}: {} pinned, not here", path, v));
    }
    for (const auto& v : b) {
      if (!a.count(v)) out.push_back(fmt::format("{}: {} here, not pinned", path, v));
    }
    return;
  }
  if (pinned != current)
    out.push_back(fmt::format("{}: {} -> {}", path, pinned.dump(), current.dump()));
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

namespace {
// A data or model identity with the config's free-text revision beside its hashes.
json with_revision(json identity, const std::optional<std::string>& revision) {
  if (!identity.is_object() || !revision) return identity;
  // The config's revision pins what the user names; without one, the identity's own (a prepared
  // token directory's data.json revision) stands.
  if (!revision->empty()) {
    identity["revision"] = *revision;
  } else if (!identity.contains("revision")) {
    identity["revision"] = nullptr;
  }
  return identity;
}
}  // namespace

json environment_pins() {
  json pins;
  const std::string python = build_info().python;
  if (python.empty()) {
    pins["python"] = {{"executable", nullptr},
                      {"pip_freeze", nullptr},
                      {"note", "kiln was built without KILN_PYTHON"}};
  } else {
    auto version = command_output("'" + python +
                                  "' -c 'import sys; print(sys.version.split()[0])' 2>/dev/null");
    auto freeze =
        command_output("'" + python + "' -m pip freeze --disable-pip-version-check 2>/dev/null");
    pins["python"] = {{"executable", python},
                      {"version", version ? json(std::string(trim(*version))) : json(nullptr)},
                      {"pip_freeze", freeze ? json(lines_of(*freeze)) : json(nullptr)}};
  }
  // The Debian packages the build uses (scripts/setup installs them), with their versions.
  static const char* const kBuildPackages[] = {"cmake",
                                               "ninja-build",
                                               "g++",
                                               "libstdc++6",
                                               "libgtest-dev",
                                               "libgmock-dev",
                                               "libtomlplusplus-dev",
                                               "nlohmann-json3-dev",
                                               "libcli11-dev",
                                               "libfmt-dev",
                                               "libxxhash-dev",
                                               "zlib1g-dev",
                                               "libgloo-dev",
                                               "python3-venv",
                                               "ccache"};
  std::string query = "dpkg-query -W -f='${Package}=${Version}\\n'";
  for (const char* p : kBuildPackages) query += std::string(" ") + p;
  // dpkg-query exits 1 when some package is not installed; it still lists the others.
  auto packages = command_output(query + " 2>/dev/null || true");
  pins["debian_packages"] = packages ? json(lines_of(*packages)) : json(nullptr);
  pins["recorded_utc"] = utc_now_iso8601();
  return pins;
}

std::vector<std::string> manifest_differences(const json& pinned, const json& current) {
  static const char* const kVolatile[] = {"command_line", "start_time_utc", "device", "world_size"};
  json a = pinned, b = current;
  for (const char* key : kVolatile) {
    a.erase(key);
    b.erase(key);
  }
  if (a.contains("pins")) a["pins"].erase("recorded_utc");
  if (b.contains("pins")) b["pins"].erase("recorded_utc");
  std::vector<std::string> out;
  collect_differences(a, b, "", out);
  // A revision that stayed while the content changed is the worst kind: say so first.
  for (const char* part : {"data", "model"}) {
    if (!a.contains(part) || !b.contains(part) || !a[part].is_object() || !b[part].is_object())
      continue;
    const json ra = a[part].value("revision", json(nullptr));
    if (!ra.is_null() && ra == b[part].value("revision", json(nullptr)) && a[part] != b[part]) {
      out.insert(out.begin(),
                 fmt::format("{}.revision {} is unchanged but the {}'s content hash changed", part,
                             ra.dump(), part));
    }
  }
  return out;
}

json make_manifest(const Config& config, const std::string& command_line,
                   const std::string& start_time_utc, const json& data, const json& model) {
  const BuildInfo& build = build_info();
  const ManifestPins pins = ManifestPins::from_config(config);
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
      {"container", container_pin()},
      {"config",
       {{"file", config.source().empty() ? json(nullptr) : json(config.source().string())},
        {"hash_xxh64", config.hash()}}},
      {"seeds", {{"run.seed", pins.run_seed}, {"data.seed", pins.data_seed}}},
      {"deterministic", pins.deterministic},
      {"data", with_revision(data, pins.data_revision)},
      {"model", with_revision(model, pins.model_revision)},
      {"command_line", command_line},
      {"start_time_utc", start_time_utc},
  };
}

std::filesystem::path prepare_run_records(const std::filesystem::path& dir,
                                          const std::string& metrics_file,
                                          RunOptions::Existing existing) {
  namespace fs = std::filesystem;
  if (existing == RunOptions::Existing::kReplace) return {};
  std::error_code ec;
  std::vector<std::string> records, files;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (!it->is_regular_file(ec) || it->is_symlink(ec)) continue;
    const std::string name = it->path().filename().string();
    if (name == kRunLockFile) continue;
    files.push_back(name);
    const bool nonempty = it->file_size(ec) > 0;
    if ((nonempty && (name == metrics_file || name == "train.log")) ||
        name.starts_with("events.out.tfevents.")) {
      records.push_back(name);
    }
  }
  if (records.empty()) return {};
  std::sort(records.begin(), records.end());
  if (existing == RunOptions::Existing::kRefuse) {
    std::string list;
    for (const auto& r : records) list += (list.empty() ? "" : ", ") + r;
    throw UserError(fmt::format(
        "run directory {} holds another run's records ({}); continue that run with --resume "
        "auto, move its records aside with --overwrite, or set run.name",
        dir.string(), list));
  }
  std::string stamp = utc_now_iso8601();  // 2026-11-29T08:26:23Z -> 20261129T082623Z
  stamp.erase(
      std::remove_if(stamp.begin(), stamp.end(), [](char c) { return c == '-' || c == ':'; }),
      stamp.end());
  fs::path aside = dir / ("previous-" + stamp);
  for (int n = 2; fs::exists(aside, ec); ++n) aside = dir / fmt::format("previous-{}-{}", stamp, n);
  fs::create_directory(aside, ec);
  if (ec) {
    throw UserError("cannot create " + aside.string() + ": " + ec.message() +
                    "; check run.dir's permissions");
  }
  for (const auto& name : files) {
    fs::rename(dir / name, aside / name, ec);
    if (ec) {
      throw UserError("cannot move " + (dir / name).string() + " into " + aside.string() + ": " +
                      ec.message() + "; move the earlier run's records by hand");
    }
  }
  log::warn(fmt::format("{}: a fresh run; moved the earlier run's {} files ({}) into {}",
                        dir.string(), files.size(), fmt::join(records, ", "), aside.string()));
  return aside;
}

Run::Run(const Config& config, RunOptions options)
    : config_(config), options_(std::move(options)), dir_(run_directory(config)) {
  std::vector<const char*> argv;
  for (const auto& arg : options_.argv) argv.push_back(arg.c_str());
  command_line_ = join_command_line(static_cast<int>(argv.size()), argv.data());
  start_time_utc_ = utc_now_iso8601();
  if (!options_.rung.empty()) {  // a rung alone: its records apart from a training run's
    const std::string& rung = options_.rung;
    if (options_.metrics_file == "metrics.jsonl")
      options_.metrics_file = "metrics-" + rung + ".jsonl";
    log_file_ = rung + ".log";
    std::error_code ec;
    const auto trained = dir_ / "metrics.jsonl";
    if (std::filesystem::is_regular_file(trained, ec) &&
        std::filesystem::file_size(trained, ec) > 0) {
      config_file_ = "config-" + rung + ".toml";
      manifest_file_ = "manifest-" + rung + ".json";
    }
  }
  if (!options_.writer) return;
  if (!options_.append_metrics)
    prepare_run_records(dir_, options_.metrics_file, options_.existing_records);
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) {
    throw UserError("cannot create run directory " + dir_.string() + ": " + ec.message() +
                    "; set run.dir to a writable place");
  }
  write_text(config_file_, config_.to_toml(true));
  log::set_file(dir_ / log_file_);
  const auto metrics_path = dir_ / options_.metrics_file;
  if (options_.append_metrics) repair_torn_last_line(metrics_path);
  metrics_fd_ = ::open(
      metrics_path.c_str(),
      O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (options_.append_metrics ? 0 : O_TRUNC), 0644);
  if (metrics_fd_ < 0) {
    throw UserError("cannot write " + metrics_path.string() + ": " + errno_text() +
                    "; check run.dir's permissions");
  }
}

Run::~Run() {
  if (metrics_fd_ >= 0) ::close(metrics_fd_);
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
  if (!options_.writer || metrics_fd_ < 0) return;
  const std::string line = record.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  ssize_t n = -1;
  do {
    n = ::write(metrics_fd_, line.data(), line.size());  // the whole line at once (O_APPEND)
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(line.size()) && !metrics_failed_) {
    metrics_failed_ = true;
    log::warn(fmt::format("cannot append to {}: {}; training goes on without its step records",
                          (dir_ / options_.metrics_file).string(),
                          n < 0 ? errno_text() : std::string("short write (device full?)")));
  }
}

void Run::write_manifest(const json& data, const json& model, const json& extra) const {
  json manifest = make_manifest(config_, command_line_, start_time_utc_, data, model);
  for (auto& [key, value] : extra.items()) manifest[key] = value;
  write_json(manifest_file_, manifest);
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
