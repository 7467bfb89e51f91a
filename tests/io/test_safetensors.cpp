// safetensors reader/writer and CheckpointDir. Files are built in a temp dir, either with our
// writer or byte by byte, so the hostile cases need no Python.
#include "qlora/io/checkpoint_dir.h"
#include "qlora/io/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <ftw.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>

namespace ck = qlora::io;

namespace {

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "qlora_st_XXXXXX";
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    ::nftw(path_.c_str(), [](const char* p, const struct stat*, int, FTW*) { return std::remove(p); }, 16,
           FTW_DEPTH | FTW_PHYS);
  }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string le64(uint64_t v) {
  std::string s;
  for (int i = 0; i < 8; ++i) s += static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A file with the given header text and data; claimed_len overrides the length prefix.
std::string raw_file(const std::string& path, const std::string& header, const std::string& data,
                     int64_t claimed_len = -1) {
  write_bytes(path, le64(claimed_len < 0 ? header.size() : uint64_t(claimed_len)) + header + data);
  return path;
}

// Runs fn, expects a SafetensorsError whose message contains every needle.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected SafetensorsError";
  } catch (const ck::SafetensorsError& e) {
    const std::string msg = e.what();
    for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

std::vector<ck::Dtype> all_dtypes() {
  return {ck::Dtype::F64, ck::Dtype::F32, ck::Dtype::F16, ck::Dtype::BF16,
          ck::Dtype::I8,  ck::Dtype::U8,  ck::Dtype::I32, ck::Dtype::I64};
}

}  // namespace

TEST(SafetensorsDtype, NamesSizesAndScalarTypesAgree) {
  for (ck::Dtype d : all_dtypes()) {
    EXPECT_EQ(ck::parse_dtype(ck::dtype_name(d)), d);
    EXPECT_EQ(ck::from_scalar_type(ck::to_scalar_type(d)), d);
    EXPECT_EQ(ck::dtype_size(d), int(c10::elementSize(ck::to_scalar_type(d))));
  }
  EXPECT_THROW(ck::from_scalar_type(at::kComplexFloat), ck::SafetensorsError);
  expect_error([] { ck::parse_dtype("C64"); }, {"C64", "BF16"});
}

TEST(Safetensors, RoundTripsEveryDtypeScalarAndEmpty) {
  TempDir dir;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (ck::Dtype d : all_dtypes()) {
    const at::ScalarType st = ck::to_scalar_type(d);
    const std::string n = ck::dtype_name(d);
    // Values stay small so every dtype, I8 and U8 included, holds them exactly.
    tensors.emplace_back(n + ".matrix", at::arange(0, 12, at::kFloat).reshape({3, 4}).to(st));
    tensors.emplace_back(n + ".scalar", at::full({}, 7, at::TensorOptions().dtype(st)));
    tensors.emplace_back(n + ".empty", at::empty({0, 5}, at::TensorOptions().dtype(st)));
  }
  tensors.emplace_back("strided", at::arange(0, 6, at::kFloat).reshape({2, 3}).t());  // non-contiguous input
  const std::string path = dir / "all.safetensors";
  ck::save_safetensors(path, tensors, {{"format", "pt"}, {"note", "héllo"}});
  EXPECT_FALSE(exists(path + ".tmp"));

  ck::SafetensorsFile f = ck::SafetensorsFile::open(path);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "héllo");
  ASSERT_EQ(f.tensors().size(), tensors.size());
  for (const auto& [name, want] : tensors) {
    at::Tensor got = f.tensor(name);
    EXPECT_EQ(got.scalar_type(), want.scalar_type()) << name;
    EXPECT_EQ(got.sizes(), want.sizes()) << name;
    EXPECT_TRUE(at::equal(got, want)) << name;
    EXPECT_EQ(f.info(name).numel(), want.numel()) << name;
  }
  // save_safetensors puts wide dtypes first, so every tensor is aligned and zero-copy.
  for (const ck::TensorInfo& t : f.tensors())
    EXPECT_EQ((f.data_offset() + t.begin) % ck::dtype_size(t.dtype), 0u) << t.name;
  EXPECT_EQ(f.find("missing"), nullptr);
  expect_error([&] { f.info("missing"); }, {path, "missing"});
}

TEST(Safetensors, WriterProducesExactSpecLayout) {
  TempDir dir;
  const std::string path = dir / "layout.safetensors";
  ck::SafetensorsWriter w(path,
                          {{"a", ck::Dtype::U8, {3}}, {"b", ck::Dtype::F32, {}}, {"e", ck::Dtype::I64, {0, 2}}},
                          {{"format", "pt"}});
  const uint8_t a[3] = {1, 2, 3};
  const float b = 1.0f;
  std::string chunk(reinterpret_cast<const char*>(a) + 1, 2);
  chunk.append(reinterpret_cast<const char*>(&b), 4);
  w.write(a, 1);
  w.write(chunk.data(), chunk.size());  // spans the end of "a" and all of "b"
  w.commit();

  // 191 bytes of JSON + 1 space of padding = 192, so the data starts at 200, a multiple of 8.
  const std::string json =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
      R"("b":{"dtype":"F32","shape":[],"data_offsets":[3,7]},"e":{"dtype":"I64","shape":[0,2],"data_offsets":[7,7]}})";
  ASSERT_EQ(json.size(), 191u);
  const std::string expected = std::string("\xC0\0\0\0\0\0\0\0", 8) + json + " " + "\x01\x02\x03" +
                               std::string("\x00\x00\x80\x3F", 4);
  EXPECT_EQ(read_bytes(path), expected);
  EXPECT_EQ(w.file_size(), expected.size());

  // "b" sits at an odd offset: tensor() must still be right (it copies instead of aliasing).
  ck::SafetensorsFile f = ck::SafetensorsFile::open(path);
  EXPECT_EQ(f.tensors()[1].name, "b");
  at::Tensor tb = f.tensor("b");
  EXPECT_EQ(tb.item<float>(), 1.0f);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(tb.data_ptr()) % 4, 0u);
  EXPECT_EQ(f.tensor("e").sizes(), (std::vector<int64_t>{0, 2}));
}

TEST(Safetensors, TensorIsZeroCopyAndOutlivesTheFile) {
  TempDir dir;
  const std::string path = dir / "w.safetensors";
  at::Tensor w = at::randn({256, 1024});  // 1 MiB: spans many pages, so release() has work to do
  ck::save_safetensors(path, {{"w", w}, {"bias", at::ones({7}, at::kBFloat16)}});
  at::Tensor t;
  {
    ck::SafetensorsFile f = ck::SafetensorsFile::open(path);
    t = f.tensor("w");
    EXPECT_EQ(t.data_ptr(), static_cast<const void*>(f.data("w")));
    EXPECT_TRUE(at::equal(t, w));
    f.release("w");  // pages dropped; the next read faults them back in from the file
    EXPECT_TRUE(at::equal(t, w));
    ck::SafetensorsFile moved = std::move(f);
    EXPECT_TRUE(at::equal(moved.tensor("bias"), at::ones({7}, at::kBFloat16)));
  }
  EXPECT_TRUE(at::equal(t, w));  // the tensor holds the mapping alive
}

// --- hostile files ------------------------------------------------------------------------------

class SafetensorsMalformed : public ::testing::Test {
 protected:
  // Each message must name the file, plus whatever the case adds.
  void expect_rejected(const std::string& header, const std::string& data, std::vector<std::string> needles,
                       int64_t claimed_len = -1) {
    const std::string path = raw_file(dir_ / "bad.safetensors", header, data, claimed_len);
    needles.push_back(path);
    expect_error([&] { ck::SafetensorsFile::open(path); }, needles);
  }
  TempDir dir_;
};

TEST_F(SafetensorsMalformed, TruncatedBeforeLength) {
  const std::string path = dir_ / "short.safetensors";
  write_bytes(path, std::string("\x05\0\0\0\0", 5));
  expect_error([&] { ck::SafetensorsFile::open(path); }, {path, "5 bytes", "8-byte"});
}

TEST_F(SafetensorsMalformed, HeaderLongerThanFile) { expect_rejected("{}", "", {"1000", "truncated"}, 1000); }

TEST_F(SafetensorsMalformed, HeaderOver100MiB) { expect_rejected("{}", "", {"100 MiB"}, int64_t(200) << 20); }

TEST_F(SafetensorsMalformed, BadJson) { expect_rejected(R"({"a": {"dtype": )", "", {"JSON"}); }

TEST_F(SafetensorsMalformed, HeaderNotAnObject) { expect_rejected("[1, 2]", "", {"object"}); }

TEST_F(SafetensorsMalformed, EntryNotAnObject) { expect_rejected(R"({"w": 3})", "", {"'w'", "object"}); }

TEST_F(SafetensorsMalformed, MissingDtype) {
  expect_rejected(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", "x", {"'w'", "dtype"});
}

TEST_F(SafetensorsMalformed, UnknownDtype) {
  expect_rejected(R"({"w":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})", "x",
                  {"'w'", "F8_E4M3", "supported", "BF16"});
  expect_rejected(R"({"q":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", "x", {"'q'", "Q4"});
}

TEST_F(SafetensorsMalformed, NegativeOrFractionalDim) {
  expect_rejected(R"({"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})", "", {"'w'", "non-negative"});
  expect_rejected(R"({"w":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}})", "xx", {"'w'", "non-negative"});
}

TEST_F(SafetensorsMalformed, ShapeProductOverflow) {
  expect_rejected(R"({"w":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,4]}})",
                  std::string(4, 0), {"'w'", "overflow"});
}

TEST_F(SafetensorsMalformed, ShapeLargerThanData) {
  expect_rejected(R"({"w":{"dtype":"F32","shape":[1000],"data_offsets":[0,4000]}})", std::string(4, 0),
                  {"'w'", "4000"});
}

TEST_F(SafetensorsMalformed, DataOffsetsWrongForm) {
  expect_rejected(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", "x", {"'w'", "data_offsets"});
  expect_rejected(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", "x", {"'w'", "data_offsets"});
  expect_rejected(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[1,0]}})", "x", {"'w'", "begin <= end"});
}

TEST_F(SafetensorsMalformed, OffsetsOutOfRange) {
  expect_rejected(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})", std::string(8, 0),
                  {"'w'", "[8, 12]", "8"});
}

TEST_F(SafetensorsMalformed, ByteCountDisagreesWithShape) {
  expect_rejected(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})", std::string(8, 0),
                  {"'w'", "span 8", "needs 4"});
}

TEST_F(SafetensorsMalformed, OverlappingTensors) {
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                  std::string(12, 0), {"'b'", "overlap", "'a'"});
}

TEST_F(SafetensorsMalformed, HoleBetweenTensors) {
  expect_rejected(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})",
                  std::string(12, 0), {"'b'", "hole of 4 bytes"});
}

TEST_F(SafetensorsMalformed, TrailingBytes) {
  expect_rejected(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", std::string(8, 0), {"trailing"});
}

TEST_F(SafetensorsMalformed, DuplicateTensorName) {
  expect_rejected(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                  R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                  "xy", {"'a'", "twice"});
}

TEST_F(SafetensorsMalformed, MetadataValueNotString) {
  expect_rejected(R"({"__metadata__":{"epoch":1}})", "", {"__metadata__", "epoch", "string"});
  expect_rejected(R"({"__metadata__":[]})", "", {"__metadata__"});
}

// Random damage to a valid file (byte flips in header and data, truncation, a wrong length
// prefix) must end in either a clean open or a SafetensorsError: never a crash, never a tensor
// that reads outside the file. ASan builds make this a sharper check.
TEST_F(SafetensorsMalformed, RandomCorruptionsFailCleanly) {
  const std::string good = dir_ / "good.safetensors";
  ck::save_safetensors(good, {{"a.weight", at::randn({7, 5})}, {"b", at::arange(10, at::kLong)},
                              {"c", at::ones({3}, at::kBFloat16)}},
                       {{"format", "pt"}});
  const std::string bytes = read_bytes(good);
  std::mt19937 rng(42);
  int opened = 0, rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string b = bytes;
    switch (trial % 3) {
      case 0:  // flip 1-4 bytes anywhere
        for (int k = 0, n = 1 + rng() % 4; k < n; ++k) b[rng() % b.size()] ^= static_cast<char>(1 + rng() % 255);
        break;
      case 1:  // truncate
        b.resize(rng() % b.size());
        break;
      default:  // replace a header character with a JSON-significant one
        b[8 + rng() % (b.size() > 8 ? std::min<size_t>(b.size() - 8, 200) : 1)] = "{}[]\",:0-9e"[rng() % 12];
    }
    const std::string path = dir_ / "fuzz.safetensors";
    write_bytes(path, b);
    try {
      const ck::SafetensorsFile f = ck::SafetensorsFile::open(path);
      for (const auto& ti : f.tensors()) {
        ASSERT_LE(f.data_offset() + ti.end, b.size());
        (void)f.tensor(ti.name).sum();  // touch the bytes
      }
      ++opened;
    } catch (const ck::SafetensorsError& e) {
      ASSERT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 1000);  // most damage must be caught
  EXPECT_GT(opened, 0);       // and flips inside the data are still valid files
}

TEST_F(SafetensorsMalformed, EmptyFileWithValidHeaderIsFine) {
  // The edge of the valid range: no tensors, no data, spaces after the JSON.
  const std::string path = raw_file(dir_ / "empty.safetensors", "{}      ", "");
  EXPECT_TRUE(ck::SafetensorsFile::open(path).tensors().empty());
}

// --- writer -------------------------------------------------------------------------------------

TEST(SafetensorsWriter, UncommittedWriterLeavesOldFileAndNoTmp) {
  TempDir dir;
  const std::string path = dir / "model.safetensors";
  ck::save_safetensors(path, {{"w", at::arange(4, at::kFloat)}});
  const std::string before = read_bytes(path);
  {
    ck::SafetensorsWriter w(path, {{"w", ck::Dtype::F32, {8}}});
    w.write_tensor(at::zeros({8}));  // complete, but never committed
    EXPECT_TRUE(exists(path + ".tmp"));
  }
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_FALSE(exists(path + ".tmp"));
  {
    ck::SafetensorsWriter w(path, {{"w", ck::Dtype::F32, {8}}});
    float half[4] = {};
    w.write(half, sizeof half);  // abandoned half way, as by an exception in the caller
  }
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_FALSE(exists(path + ".tmp"));
}

TEST(SafetensorsWriter, RejectsWrongByteCounts) {
  TempDir dir;
  const std::string path = dir / "x.safetensors";
  {
    ck::SafetensorsWriter w(path, {{"a", ck::Dtype::F32, {2}}, {"b", ck::Dtype::I8, {3}}});
    char bytes[12] = {};
    expect_error([&] { w.write(bytes, 12); }, {path, "'b'", "overflow"});
    w.write(bytes, 9);  // the failed write wrote nothing, so this still fits
    expect_error([&] { w.commit(); }, {path, "'b'", "incomplete"});
    w.write(bytes, 2);
    w.commit();
    expect_error([&] { w.write(bytes, 1); }, {path, "committed"});
  }
  EXPECT_EQ(ck::SafetensorsFile::open(path).tensors().size(), 2u);
}

TEST(SafetensorsWriter, WriteTensorChecksDtypeShapeAndOrder) {
  TempDir dir;
  const std::string path = dir / "x.safetensors";
  ck::SafetensorsWriter w(path, {{"a", ck::Dtype::BF16, {2, 2}}, {"e", ck::Dtype::F32, {0}}, {"b", ck::Dtype::I64, {}}});
  expect_error([&] { w.write_tensor(at::zeros({2, 2})); }, {path, "'a'", "BF16 [2, 2]", "Float"});
  expect_error([&] { w.write_tensor(at::zeros({4}, at::kBFloat16)); }, {path, "'a'", "[4]"});
  w.write_tensor(at::ones({2, 2}, at::kBFloat16));
  w.write_tensor(at::full({}, 5, at::kLong));  // skips the empty entry "e" implicitly
  expect_error([&] { w.write_tensor(at::zeros({1})); }, {path, "every declared entry"});
  w.commit();
  ck::SafetensorsFile f = ck::SafetensorsFile::open(path);
  EXPECT_EQ(f.tensor("b").item<int64_t>(), 5);
  EXPECT_EQ(f.tensor("e").numel(), 0);
  expect_error([&] { ck::SafetensorsWriter(dir / "d.safetensors", {{"a", ck::Dtype::U8, {1}}, {"a", ck::Dtype::U8, {1}}}); },
               {"'a'", "twice"});
  EXPECT_FALSE(exists(dir / "d.safetensors.tmp"));
}

// --- checkpoint directories ---------------------------------------------------------------------

class CheckpointDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ck::save_safetensors(dir_ / kShard1, {{"a", at::arange(6, at::kFloat)}, {"b", at::ones({2, 2}, at::kHalf)}});
    ck::save_safetensors(dir_ / kShard2, {{"c", at::arange(3, at::kLong)}});
  }
  void write_index(const std::map<std::string, std::string>& weight_map) {
    ck::write_safetensors_index(dir_ / "model.safetensors.index.json", weight_map, 12345);
  }
  static constexpr const char* kShard1 = "model-00001-of-00002.safetensors";
  static constexpr const char* kShard2 = "model-00002-of-00002.safetensors";
  TempDir dir_;
};

TEST_F(CheckpointDirTest, ShardedWithIndex) {
  write_index({{"a", kShard1}, {"b", kShard1}, {"c", kShard2}});
  ck::CheckpointDir c = ck::CheckpointDir::open(dir_.path());
  EXPECT_TRUE(c.is_sharded());
  EXPECT_EQ(c.tensor_names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(c.files(), (std::vector<std::string>{dir_ / kShard1, dir_ / kShard2}));
  EXPECT_EQ(c.file_of("c").path(), dir_ / kShard2);
  EXPECT_TRUE(at::equal(c.tensor("c"), at::arange(3, at::kLong)));
  EXPECT_TRUE(at::equal(c.tensor("a"), at::arange(6, at::kFloat)));
  expect_error([&] { c.tensor("zzz"); }, {dir_.path(), "zzz"});
}

TEST_F(CheckpointDirTest, SingleFileOrModelSafetensors) {
  ck::CheckpointDir file = ck::CheckpointDir::open(dir_ / kShard2);
  EXPECT_FALSE(file.is_sharded());
  EXPECT_EQ(file.tensor_names(), (std::vector<std::string>{"c"}));
  ASSERT_EQ(std::rename((dir_ / kShard1).c_str(), (dir_ / "model.safetensors").c_str()), 0);
  ck::CheckpointDir d = ck::CheckpointDir::open(dir_.path());
  EXPECT_EQ(d.files(), (std::vector<std::string>{dir_ / "model.safetensors"}));
  EXPECT_TRUE(d.contains("b"));
}

TEST_F(CheckpointDirTest, MissingShard) {
  write_index({{"a", kShard1}, {"c", "model-00003-of-00003.safetensors"}});
  expect_error([&] { ck::CheckpointDir::open(dir_.path()); }, {dir_.path(), "model-00003-of-00003.safetensors"});
}

TEST_F(CheckpointDirTest, TraversalShardNameRejected) {
  // Written by hand: write_safetensors_index itself refuses such names.
  write_bytes(dir_ / "model.safetensors.index.json", R"({"weight_map":{"a":"../evil.safetensors"}})");
  expect_error([&] { ck::CheckpointDir::open(dir_.path()); }, {"../evil.safetensors", "'a'"});
  write_bytes(dir_ / "model.safetensors.index.json", R"({"weight_map":{"a":"sub/x.safetensors"}})");
  expect_error([&] { ck::CheckpointDir::open(dir_.path()); }, {"sub/x.safetensors"});
  expect_error([&] { write_index({{"a", "../x"}}); }, {"../x"});
}

TEST_F(CheckpointDirTest, IndexAndShardsDisagree) {
  write_index({{"a", kShard1}, {"b", kShard1}, {"c", kShard2}, {"d", kShard2}});
  expect_error([&] { ck::CheckpointDir::open(dir_.path()); }, {"'d'", "absent", kShard2});
  write_index({{"a", kShard2}, {"b", kShard1}, {"c", kShard2}});
  expect_error([&] { ck::CheckpointDir::open(dir_.path()); }, {"'a'", "stored in"});
  write_index({{"a", kShard1}, {"c", kShard2}});
  expect_error([&] { ck::CheckpointDir::open(dir_.path()); }, {"'b'", "not listed"});
}

TEST_F(CheckpointDirTest, TensorInTwoShards) {
  ck::save_safetensors(dir_ / kShard2, {{"a", at::zeros({1})}, {"c", at::arange(3, at::kLong)}});
  write_index({{"a", kShard1}, {"b", kShard1}, {"c", kShard2}});
  expect_error([&] { ck::CheckpointDir::open(dir_.path()); }, {"'a'", "two shards"});
}

TEST_F(CheckpointDirTest, NothingToOpen) {
  TempDir empty;
  expect_error([&] { ck::CheckpointDir::open(empty.path()); }, {empty.path(), "model.safetensors"});
  expect_error([&] { ck::CheckpointDir::open(empty / "nope"); }, {"nope"});
}

TEST_F(CheckpointDirTest, IndexFormatMatchesTransformers) {
  write_index({{"b", kShard1}, {"a", kShard1}, {"c", kShard2}});
  const std::string text = read_bytes(dir_ / "model.safetensors.index.json");
  EXPECT_EQ(text.rfind("{\n  \"metadata\": {\n    \"total_size\": 12345\n  },\n  \"weight_map\": {\n    \"a\": ", 0), 0u)
      << text;
  EXPECT_EQ(text.back(), '\n');
  const auto j = nlohmann::json::parse(text);
  EXPECT_EQ(j["metadata"]["total_size"].get<uint64_t>(), 12345u);
  EXPECT_EQ(j["weight_map"]["c"].get<std::string>(), kShard2);
  EXPECT_FALSE(exists(dir_ / "model.safetensors.index.json.tmp"));
}
