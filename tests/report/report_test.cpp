// report/ and models/hf: CRC-32C against published vectors, TensorBoard record framing, the
// Hugging Face config check and round trip, and the CLI's refusals. (report.html and the typed
// rung results: html_test.cpp; the tools kiln did not write read the same files in
// interop_test.py and browser_test.py.)
#include <gtest/gtest.h>

#include <cstring>

#include "kiln/error.h"
#include "kiln/hf.h"
#include "kiln/pilot.h"
#include "kiln/safetensors.h"
#include "kiln/tensorboard.h"
#include "support/helpers.h"

namespace kiln {
namespace {

using testing::TempDir;

TEST(Crc32c, PublishedVectors) {
  const char* digits = "123456789";
  EXPECT_EQ(crc32c(digits, 9), 0xE3069283u);
  // RFC 3720 (iSCSI) B.4: 32 zero bytes, 32 0xFF bytes, 32 ascending bytes.
  unsigned char bytes[32];
  std::memset(bytes, 0, sizeof(bytes));
  EXPECT_EQ(crc32c(bytes, 32), 0x8A9136AAu);
  std::memset(bytes, 0xFF, sizeof(bytes));
  EXPECT_EQ(crc32c(bytes, 32), 0x62A8AB43u);
  for (int k = 0; k < 32; ++k) bytes[k] = static_cast<unsigned char>(k);
  EXPECT_EQ(crc32c(bytes, 32), 0x46DD794Eu);
  // Continuing a CRC over a split buffer gives the whole buffer's.
  EXPECT_EQ(crc32c(bytes + 10, 22, crc32c(bytes, 10)), 0x46DD794Eu);
  // TFRecord's mask: rotate right 15, add 0xa282ead8.
  const uint32_t crc = crc32c(digits, 9);
  EXPECT_EQ(masked_crc32c(digits, 9), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

uint64_t read_u64(const std::string& s, size_t at) {
  uint64_t v;
  std::memcpy(&v, s.data() + at, 8);
  return v;
}
uint32_t read_u32(const std::string& s, size_t at) {
  uint32_t v;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}

TEST(TensorBoardWriter, FramesEachRecordWithMaskedCrcs) {
  TempDir dir;
  std::filesystem::path path;
  {
    TensorBoardWriter writer(dir / "tb");
    path = writer.path();
    writer.add_scalar("train/loss", 3, 1.5);
    writer.add_scalar("val/loss", 4, 0.25);
    TensorBoardWriter second(dir / "tb");  // the same second: another name
    EXPECT_NE(second.path(), path);
  }
  EXPECT_TRUE(path.filename().string().starts_with("events.out.tfevents."));
  const std::string bytes = testing::slurp(path);
  size_t at = 0;
  std::vector<std::string> records;
  while (at < bytes.size()) {
    ASSERT_LE(at + 12, bytes.size());
    const uint64_t length = read_u64(bytes, at);
    EXPECT_EQ(read_u32(bytes, at + 8), masked_crc32c(bytes.data() + at, 8));
    ASSERT_LE(at + 16 + length, bytes.size());
    records.push_back(bytes.substr(at + 12, length));
    EXPECT_EQ(read_u32(bytes, at + 12 + length), masked_crc32c(records.back().data(), length));
    at += 16 + length;
  }
  ASSERT_EQ(records.size(), 3u);
  EXPECT_NE(records[0].find("brain.Event:2"), std::string::npos);
  EXPECT_NE(records[1].find("train/loss"), std::string::npos);
  const float value = 1.5f;  // simple_value: field 2, wire type 5, then the float
  std::string tail("\x15", 1);
  tail.append(reinterpret_cast<const char*>(&value), 4);
  EXPECT_TRUE(records[1].ends_with(tail));
  EXPECT_NE(records[2].find("val/loss"), std::string::npos);
}

std::shared_ptr<Model> tiny_gpt(const std::filesystem::path& dir, int64_t seed,
                                const std::vector<std::string>& extra = {}) {
  std::vector<std::string> sets = {"model.n_layer=1", "model.n_embd=16", "model.n_head=2",
                                   "model.block_size=32", "run.seed=" + std::to_string(seed)};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return make_model(testing::gpt_config(dir, sets));
}

TEST(HuggingFace, ConfigMismatchNamesTheFieldAndTheKey) {
  GptConfig gpt{2, 2, 32, 64, 256};
  const nlohmann::json config = hf_gpt2_config(gpt);
  EXPECT_EQ(hf_gpt2_config_mismatch(config, gpt), "");
  auto changed = config;
  changed["n_embd"] = 48;
  EXPECT_EQ(hf_gpt2_config_mismatch(changed, gpt),
            "config.json has n_embd = 48 but the model has model.n_embd = 32: set model.n_embd "
            "= 48");
  changed = config;
  changed["n_positions"] = 1024;
  EXPECT_NE(hf_gpt2_config_mismatch(changed, gpt).find("model.block_size = 1024"),
            std::string::npos);
  changed = config;
  changed["tie_word_embeddings"] = false;
  EXPECT_NE(hf_gpt2_config_mismatch(changed, gpt).find("tie_word_embeddings"), std::string::npos);
  changed = config;
  changed["activation_function"] = "relu";
  EXPECT_NE(hf_gpt2_config_mismatch(changed, gpt).find("relu"), std::string::npos);
}

TEST(HuggingFace, ExportThenInitFromGivesTheSameWeights) {
  TempDir dir;
  auto source = tiny_gpt(dir / "runs", 1);
  save_hf_gpt2(*source, dir / "hf", /*force=*/false);
  // HF's Conv1D layout: c_fc's weight is [in, out] on disk.
  for (const auto& entry : read_safetensors_header(dir / "hf" / "model.safetensors").tensors) {
    if (entry.name == "transformer.h.0.mlp.c_fc.weight") {
      EXPECT_EQ(entry.shape, (std::vector<int64_t>{16, 64}));
    }
  }
  auto loaded = tiny_gpt(dir / "runs", 2, {"model.init_from=" + (dir / "hf").string()});
  EXPECT_EQ(weights_hash(*loaded), weights_hash(*source));
  ASSERT_TRUE(loaded->init_from.is_object());
  EXPECT_EQ(loaded->init_from["files"].size(), 1u);
  EXPECT_EQ(loaded->init_from["files"][0]["sha256"], sha256_file(dir / "hf" / "model.safetensors"));
  EXPECT_EQ(model_identity(*loaded)["init_from"], loaded->init_from);
  EXPECT_FALSE(model_identity(*source).contains("init_from"));

  // A non-empty directory: refused, unless force.
  try {
    save_hf_gpt2(*source, dir / "hf", false);
    FAIL() << "a non-empty directory was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--force"), std::string::npos);
  }
  save_hf_gpt2(*source, dir / "hf", true);
}

TEST(HuggingFace, InitFromNamesTheFirstWrongTensor) {
  TempDir dir;
  auto source = tiny_gpt(dir / "runs", 1);
  save_hf_gpt2(*source, dir / "hf", false);
  auto tensors = read_safetensors(dir / "hf" / "model.safetensors");
  for (auto& [name, tensor] : tensors) {
    if (name == "transformer.h.0.attn.c_proj.weight") tensor = torch::zeros({16, 8});
  }
  write_safetensors(dir / "hf" / "model.safetensors", tensors, {{"format", "pt"}});
  auto target = tiny_gpt(dir / "runs", 2);
  const std::string before = weights_hash(*target);
  try {
    load_hf_gpt2(*target, dir / "hf", "model.init_from");
    FAIL() << "a wrong shape was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("transformer.h.0.attn.c_proj.weight"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("[16, 8]"), std::string::npos) << e.what();
  }
  EXPECT_EQ(weights_hash(*target), before);  // nothing copied
  // A missing tensor and an unexpected one are named too.
  tensors.erase(tensors.begin());
  tensors.emplace_back("transformer.h.7.extra", torch::zeros({2}));
  write_safetensors(dir / "hf" / "model.safetensors", tensors, {{"format", "pt"}});
  EXPECT_THROW(load_hf_gpt2(*target, dir / "hf", "model.init_from"), UserError);
  // No config.json: the key and the directory are named.
  std::filesystem::remove(dir / "hf" / "config.json");
  try {
    load_hf_gpt2(*target, dir / "hf", "model.init_from");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("model.init_from"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("no config.json"), std::string::npos);
  }
}

TEST(ReportCli, ReportAndExportRefuseBadInputInOneLine) {
  TempDir dir;
  auto result = testing::run_kiln("report " + (dir / "absent").string());
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_NE(result.err.find("not a directory"), std::string::npos) << result.err;
  std::filesystem::create_directories(dir / "run");
  testing::write_text(dir / "run" / "config.toml",
                      "[model]\nname = \"gpt\"\n[data]\nname = \"text\"\n");
  result = testing::run_kiln("export " + (dir / "run").string() + " --format hf " +
                             (dir / "out").string());
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_NE(result.err.find("no checkpoint"), std::string::npos) << result.err;
  result = testing::run_kiln("export " + (dir / "run").string() + " --format onnx " +
                             (dir / "out").string());
  EXPECT_NE(result.exit_code, 0);
}

}  // namespace
}  // namespace kiln
