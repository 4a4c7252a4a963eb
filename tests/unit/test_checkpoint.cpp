// Checkpoint container: bit-exact round trips of every type and rank, groups and listing, attributes, publication
// by atomic rename on commit, and errors that name the file and the dataset or attribute.
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "catch.hpp"
#include "files.hpp"
#include "core/error.hpp"
#include "io/checkpoint.hpp"

namespace fs = std::filesystem;
using mm::io::CheckpointReader;
using mm::io::CheckpointWriter;

using mmtest::error_of;
using mmtest::TempDir;

namespace {

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

std::size_t numel(const std::vector<std::int64_t>& shape) {
  std::size_t n = 1;
  for (const std::int64_t d : shape) n *= std::size_t(d);
  return n;
}

// Arbitrary bit patterns (NaN payloads, subnormals, infinities, signed zeros among them), so that any conversion
// or canonicalisation on the way would show.
template <class T, class U>
std::vector<T> bit_patterns(std::size_t n, U salt) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = std::bit_cast<T>(U((i + 1) * salt) ^ U(U(i) << (8 * sizeof(U) - 9)));
  return v;
}

// A valid HDF5 file that is not a readable mambamoe checkpoint: without the format attribute, or with `format`.
void write_foreign_hdf5(const std::string& path, std::optional<std::int64_t> format) {
  const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  REQUIRE(file >= 0);
  if (format) {
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t a = H5Acreate2(file, mm::io::kCheckpointFormatAttr, H5T_NATIVE_INT64, space, H5P_DEFAULT, H5P_DEFAULT);
    REQUIRE(H5Awrite(a, H5T_NATIVE_INT64, &*format) >= 0);
    H5Aclose(a);
    H5Sclose(space);
  }
  REQUIRE(H5Fclose(file) >= 0);
}

template <class T>
struct Tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<T> data;
};

}  // namespace

TEST_CASE("Checkpoint tensors and attributes round-trip bit-exactly", "[checkpoint]") {
  const TempDir tmp("roundtrip");
  const std::string path = tmp.file("ckpt.h5");

  std::vector<Tensor<float>> floats;
  for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<std::int64_t>>>{
           {"params/backbone.layers.0.mixer.in_proj.weight", {6, 5}},
           {"params/backbone.layers.0.mixer.A_log", {7}},
           {"params/backbone.layers.0.mixer.conv1d.weight", {2, 1, 3, 2}},
           {"params/backbone.norm_f.weight", {2, 3, 4}},
           {"scale", {}},
           {"params/empty", {3, 0, 2}},
       }) {
    floats.push_back({name, shape, bit_patterns<float>(numel(shape), std::uint32_t(0x9E3779B9u))});
  }
  floats[0].data[0] = -0.0f;
  floats[0].data[1] = std::numeric_limits<float>::infinity();
  floats[0].data[2] = std::numeric_limits<float>::denorm_min();
  std::vector<Tensor<double>> doubles;
  for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<std::int64_t>>>{
           {"opt/m/backbone.layers.0.mixer.in_proj.weight", {6, 5}},
           {"opt/v/backbone.layers.0.mixer.in_proj.weight", {6, 5}},
           {"opt/loss_scale", {}},
           {"opt/empty", {0}},
       }) {
    doubles.push_back({name, shape, bit_patterns<double>(numel(shape), std::uint64_t(0x9E3779B97F4A7C15ull))});
  }
  std::vector<Tensor<std::int64_t>> ints = {
      {"opt/step", {}, {123456789012345}},
      {"rng/counters", {5},
       {std::numeric_limits<std::int64_t>::min(), -1, 0, 1, std::numeric_limits<std::int64_t>::max()}},
      {"data/cursor", {2, 2, 2}, {0, 1, 2, 3, -4, -5, -6, -7}},
  };

  // The deck text is long (100 kB, beyond the 64 kB a compact attribute could hold), multi-line and UTF-8.
  std::string deck;
  for (int i = 0; deck.size() < 100 * 1024; ++i) deck += "key_" + std::to_string(i) + " = \t\xC2\xB5value " + "\n";
  const double lr = 3e-4, tiny = std::numeric_limits<double>::denorm_min();

  {
    CheckpointWriter w(path);
    for (const auto& t : floats) w.write(t.name, t.shape, t.data.data());
    for (const auto& t : doubles) w.write(t.name, t.shape, t.data.data());
    for (const auto& t : ints) w.write(t.name, t.shape, t.data.data());
    w.attr("deck", deck);
    w.attr("empty", std::string());
    w.attr("step", std::int64_t{-42});
    w.attr("tokens", std::numeric_limits<std::int64_t>::max());
    w.attr("lr", lr);
    w.attr("tiny", tiny);
    w.commit();
  }

  const CheckpointReader r(path);
  std::vector<std::string> all;
  for (const auto& t : floats) {
    CHECK(r.has(t.name));
    CHECK(r.shape(t.name) == t.shape);
    std::vector<float> got(t.data.size(), 1.0f);
    r.read(t.name, t.shape, got.data());
    CHECK(same_bits(got, t.data));
    all.push_back(t.name);
  }
  for (const auto& t : doubles) {
    CHECK(r.shape(t.name) == t.shape);
    std::vector<double> got(t.data.size(), 1.0);
    r.read(t.name, t.shape, got.data());
    CHECK(same_bits(got, t.data));
    all.push_back(t.name);
  }
  for (const auto& t : ints) {
    CHECK(r.shape(t.name) == t.shape);
    std::vector<std::int64_t> got(t.data.size(), 7);
    r.read(t.name, t.shape, got.data());
    CHECK(got == t.data);
    all.push_back(t.name);
  }
  // Names are accepted with a leading '/', and groups are not datasets.
  CHECK(r.has("/params/backbone.norm_f.weight"));
  CHECK_FALSE(r.has("params"));
  CHECK_FALSE(r.has("params/nope"));
  CHECK_FALSE(r.has("nope/deeper/still"));

  std::sort(all.begin(), all.end());
  CHECK(r.list() == all);
  CHECK(r.list("/") == all);
  CHECK(r.list("opt/m") == std::vector<std::string>{"opt/m/backbone.layers.0.mixer.in_proj.weight"});
  CHECK(r.list("/opt/") == std::vector<std::string>{"opt/empty", "opt/loss_scale",
                                                    "opt/m/backbone.layers.0.mixer.in_proj.weight", "opt/step",
                                                    "opt/v/backbone.layers.0.mixer.in_proj.weight"});

  CHECK(r.attr_string("deck") == deck);
  CHECK(r.attr_string("empty").empty());
  CHECK(r.attr_int("step") == -42);
  CHECK(r.attr_int("tokens") == std::numeric_limits<std::int64_t>::max());
  CHECK(std::bit_cast<std::uint64_t>(r.attr_double("lr")) == std::bit_cast<std::uint64_t>(lr));
  CHECK(std::bit_cast<std::uint64_t>(r.attr_double("tiny")) == std::bit_cast<std::uint64_t>(tiny));
  CHECK(r.attr_int(mm::io::kCheckpointFormatAttr) == mm::io::kCheckpointFormat);
  CHECK(r.has_attr("deck"));
  CHECK_FALSE(r.has_attr("seed"));
}

TEST_CASE("Checkpoint writer publishes the file only on commit, by rename", "[checkpoint]") {
  const TempDir tmp("publish");
  const std::string path = tmp.file("model.h5"), partial = path + ".tmp";
  const std::vector<double> v1 = {1, 2, 3}, v2 = {4, 5, 6};
  const auto read_x = [&] {
    std::vector<double> x(3);
    CheckpointReader(path).read("x", {3}, x.data());
    return x;
  };

  {
    CheckpointWriter w(path);
    w.write("x", {3}, v1.data());
    CHECK(fs::exists(partial));
    CHECK_FALSE(fs::exists(path));
    w.commit();
    CHECK_FALSE(fs::exists(partial));
    CHECK(tmp.entries() == std::vector<std::string>{"model.h5"});
    // A committed writer takes nothing more.
    const std::string late = error_of([&] { w.write("y", {3}, v2.data()); });
    CHECK_THAT(late, ContainsSubstring(path) && ContainsSubstring("'y'") && ContainsSubstring("committed"));
    CHECK_THAT(error_of([&] { w.attr("note", std::string("late")); }), ContainsSubstring("'note'"));
    CHECK_THAT(error_of([&] { w.commit(); }), ContainsSubstring(path));
  }
  CHECK(read_x() == v1);

  // An abandoned writer (say, a failure half-way through a checkpoint) leaves nothing behind.
  { CheckpointWriter(tmp.file("abandoned.h5")).write("x", {3}, v1.data()); }
  CHECK(tmp.entries() == std::vector<std::string>{"model.h5"});

  // Overwriting: the old checkpoint stays readable and intact until commit, and an abandoned overwrite keeps it.
  {
    CheckpointWriter w(path);
    w.write("x", {3}, v2.data());
    CHECK(read_x() == v1);
  }
  CHECK(read_x() == v1);
  CHECK(tmp.entries() == std::vector<std::string>{"model.h5"});
  {
    CheckpointWriter w(path);
    w.write("x", {3}, v2.data());
    CHECK(read_x() == v1);
    w.commit();
  }
  CHECK(read_x() == v2);

  // A stale temporary file from a crashed run is simply replaced.
  std::ofstream(partial) << "left over by a crash";
  {
    CheckpointWriter w(path);
    w.write("x", {3}, v1.data());
    w.commit();
  }
  CHECK(read_x() == v1);
  CHECK(tmp.entries() == std::vector<std::string>{"model.h5"});
}

TEST_CASE("Checkpoint errors name the file and the dataset or attribute", "[checkpoint]") {
  const TempDir tmp("errors");
  const std::string path = tmp.file("ckpt.h5");
  const std::int64_t n = 1 << 16;
  const std::vector<float> w(n, 0.5f);
  const std::vector<float> m = {1, 2, 3, 4, 5, 6};
  const std::int64_t step = 9;
  {
    CheckpointWriter cw(path);
    cw.write("params/w", {n}, w.data());
    cw.write("params/m", {2, 3}, m.data());
    cw.write("opt/step", {}, &step);
    cw.attr("deck", std::string("seed = 1\n"));
    cw.attr("lr", 1e-3);
    cw.attr("step", step);
    cw.commit();
  }
  const CheckpointReader r(path);
  std::vector<float> f(n);
  std::vector<double> d(n);
  std::vector<std::int64_t> i(n);

  SECTION("missing, foreign, truncated or newer files") {
    const std::string missing = tmp.file("missing.h5");
    CHECK_THAT(error_of([&] { CheckpointReader{missing}; }),
               ContainsSubstring(missing) && ContainsSubstring("no such"));

    const std::string text = tmp.file("notes.h5");
    std::ofstream(text) << "this is not HDF5\n";
    CHECK_THAT(error_of([&] { CheckpointReader{text}; }), ContainsSubstring(text) && ContainsSubstring("not an HDF5"));

    CHECK_THAT(error_of([&] { CheckpointReader{tmp.path()}; }), ContainsSubstring(tmp.path()));

    const std::string truncated = tmp.file("truncated.h5");
    fs::copy_file(path, truncated);
    fs::resize_file(truncated, fs::file_size(truncated) / 2);
    CHECK_THAT(error_of([&] {
                 const CheckpointReader t(truncated);
                 t.read("params/w", {n}, f.data());
               }),
               ContainsSubstring(truncated) && ContainsSubstring("truncated"));

    const std::string plain = tmp.file("plain.h5");
    write_foreign_hdf5(plain, std::nullopt);
    CHECK_THAT(error_of([&] { CheckpointReader{plain}; }),
               ContainsSubstring(plain) && ContainsSubstring(mm::io::kCheckpointFormatAttr));

    const std::string newer = tmp.file("newer.h5");
    write_foreign_hdf5(newer, mm::io::kCheckpointFormat + 1);
    CHECK_THAT(error_of([&] { CheckpointReader{newer}; }), ContainsSubstring(newer) && ContainsSubstring("newer"));
  }

  SECTION("missing datasets, shape and type mismatches") {
    CHECK_THAT(error_of([&] { r.read("params/nope", {n}, f.data()); }),
               ContainsSubstring(path) && ContainsSubstring("'params/nope'"));
    CHECK_THAT(error_of([&] { r.shape("nope/deeper"); }), ContainsSubstring(path) && ContainsSubstring("nope/deeper"));
    CHECK_THAT(error_of([&] { r.read("params", {n}, f.data()); }), ContainsSubstring("'params'"));
    CHECK_THAT(error_of([&] { r.read("params/m", {3, 2}, f.data()); }),
               ContainsSubstring(path) && ContainsSubstring("'params/m'") && ContainsSubstring("[2, 3]") &&
                   ContainsSubstring("[3, 2]"));
    CHECK_THAT(error_of([&] { r.read("opt/step", {1}, i.data()); }),
               ContainsSubstring("'opt/step'") && ContainsSubstring("[]") && ContainsSubstring("[1]"));
    CHECK_THAT(error_of([&] { r.read("params/m", {2, 3}, d.data()); }),
               ContainsSubstring(path) && ContainsSubstring("'params/m'") && ContainsSubstring("float32") &&
                   ContainsSubstring("float64"));
    CHECK_THAT(error_of([&] { r.read("opt/step", {}, f.data()); }),
               ContainsSubstring("'opt/step'") && ContainsSubstring("int64"));
    CHECK_THAT(error_of([&] { r.list("nope"); }), ContainsSubstring(path) && ContainsSubstring("'nope'"));
    CHECK_THAT(error_of([&] { r.list("params/m"); }), ContainsSubstring("'params/m'"));
  }

  SECTION("missing attributes and attribute type mismatches") {
    CHECK_THAT(error_of([&] { r.attr_string("seed"); }), ContainsSubstring(path) && ContainsSubstring("'seed'"));
    CHECK_THAT(error_of([&] { r.attr_int("seed"); }), ContainsSubstring("'seed'"));
    CHECK_THAT(error_of([&] { r.attr_double("seed"); }), ContainsSubstring("'seed'"));
    CHECK_THAT(error_of([&] { r.attr_int("lr"); }),
               ContainsSubstring(path) && ContainsSubstring("'lr'") && ContainsSubstring("float64"));
    CHECK_THAT(error_of([&] { r.attr_double("step"); }), ContainsSubstring("'step'") && ContainsSubstring("int64"));
    CHECK_THAT(error_of([&] { r.attr_string("step"); }), ContainsSubstring("'step'"));
    CHECK_THAT(error_of([&] { r.attr_int("deck"); }), ContainsSubstring("'deck'") && ContainsSubstring("string"));
  }

  SECTION("bad writes") {
    const std::string nowhere = tmp.file("no/such/dir/ckpt.h5");
    CHECK_THAT(error_of([&] { CheckpointWriter{nowhere}; }), ContainsSubstring(nowhere));

    const std::string out = tmp.file("out.h5");
    CheckpointWriter cw(out);
    cw.write("a/b", {2, 3}, m.data());
    CHECK_THAT(error_of([&] { cw.write("a/b", {2, 3}, m.data()); }),
               ContainsSubstring(out) && ContainsSubstring("'a/b'"));
    CHECK_THAT(error_of([&] { cw.write("a", {2, 3}, m.data()); }), ContainsSubstring("'a'"));
    CHECK_THAT(error_of([&] { cw.write("a/b/c", {2, 3}, m.data()); }),
               ContainsSubstring("'a/b/c'") && ContainsSubstring("'a/b' is a dataset"));
    CHECK_THAT(error_of([&] { cw.write("x//y", {2, 3}, m.data()); }), ContainsSubstring("'x//y'"));
    CHECK_THAT(error_of([&] { cw.write("", {2, 3}, m.data()); }), ContainsSubstring(out));
    CHECK_THAT(error_of([&] { cw.write("neg", {2, -3}, m.data()); }),
               ContainsSubstring("'neg'") && ContainsSubstring("[2, -3]"));
    CHECK_THAT(error_of([&] { cw.attr(mm::io::kCheckpointFormatAttr, std::int64_t{2}); }),
               ContainsSubstring(out) && ContainsSubstring(mm::io::kCheckpointFormatAttr));
    cw.attr("lr", 1e-3);
    CHECK_THAT(error_of([&] { cw.attr("lr", 2e-3); }), ContainsSubstring("'lr'"));
    CHECK_THAT(error_of([&] { cw.attr("deck", std::string("a\0b", 3)); }), ContainsSubstring("'deck'"));
    // The failed writes left the file consistent.
    cw.commit();
    CHECK(CheckpointReader(out).list() == std::vector<std::string>{"a/b"});
  }
}

TEST_CASE("Checkpoint reader and writer close every HDF5 handle, also on errors", "[checkpoint]") {
  const TempDir tmp("handles");
  // Open files, and groups, datasets, attributes and named types in any file.
  const auto open_ids = [] { return H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL); };
  const ssize_t before = open_ids();
  REQUIRE(before >= 0);

  const std::string path = tmp.file("ckpt.h5");
  const std::vector<float> x = {1, 2, 3, 4, 5, 6};
  {
    CheckpointWriter w(path);
    w.write("g/x", {2, 3}, x.data());
    w.attr("deck", std::string("seed = 1\n"));
    CHECK_THROWS_AS(w.write("g/x", {2, 3}, x.data()), mm::Error);
    CHECK_THROWS_AS(w.write("g/x/y", {2, 3}, x.data()), mm::Error);
    CHECK_THROWS_AS(w.attr("deck", std::int64_t{1}), mm::Error);
    w.commit();
  }
  { CheckpointWriter(tmp.file("abandoned.h5")).write("x", {6}, x.data()); }
  CHECK_THROWS_AS(CheckpointWriter(tmp.file("no/such/dir.h5")), mm::Error);
  {
    const CheckpointReader r(path);
    std::vector<float> f(6);
    std::vector<double> d(6);
    r.read("g/x", {2, 3}, f.data());
    CHECK(open_ids() > before);  // the count does see an open checkpoint
    CHECK(r.list() == std::vector<std::string>{"g/x"});
    CHECK(r.attr_string("deck") == "seed = 1\n");
    CHECK_THROWS_AS(r.read("g/x", {6}, f.data()), mm::Error);
    CHECK_THROWS_AS(r.read("g/x", {2, 3}, d.data()), mm::Error);
    CHECK_THROWS_AS(r.attr_int("deck"), mm::Error);
    CHECK_THROWS_AS(r.list("g/x"), mm::Error);
  }
  const std::string truncated = tmp.file("truncated.h5");
  fs::copy_file(path, truncated);
  fs::resize_file(truncated, fs::file_size(truncated) / 2);
  CHECK_THROWS_AS(CheckpointReader(truncated), mm::Error);
  const std::string plain = tmp.file("plain.h5");
  write_foreign_hdf5(plain, std::nullopt);
  CHECK_THROWS_AS(CheckpointReader(plain), mm::Error);

  CHECK(open_ids() == before);
}
