// The checkpoint container: one serial HDF5 file holding every tensor at its full (global) shape as one dataset
// (names with '/' go into groups) and run metadata as root attributes. Host-side only: the caller gathers device
// tensors into host buffers first. Every failure throws mm::Error with the file path as context and a message
// naming the dataset or attribute.
//
// Layout: /<group>/.../<dataset> for tensors (float32, float64 or int64, contiguous, rank 0 as a scalar
// dataspace); root attributes are scalar int64, float64 or variable-length UTF-8 strings, plus
// `mambamoe_checkpoint_format` (int64) = kCheckpointFormat, which the reader requires.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mm::io {

// Bump when the layout changes incompatibly; readers refuse files newer than they know.
inline constexpr std::int64_t kCheckpointFormat = 1;
inline constexpr const char* kCheckpointFormatAttr = "mambamoe_checkpoint_format";

// Writes to `path + ".tmp"`; commit() flushes, closes, fsyncs and renames it onto `path` atomically, so a crash
// never leaves a half-written checkpoint under the real name (an older checkpoint there stays intact until then).
// Destroying an uncommitted writer removes the temporary file.
class CheckpointWriter {
 public:
  explicit CheckpointWriter(const std::string& path);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // One dataset per tensor at its full shape, row-major. `name` may contain '/' to place it in groups (created as
  // needed), e.g. "params/backbone.layers.0.mixer.in_proj.weight". Each name may be written once.
  void write(const std::string& name, const std::vector<std::int64_t>& shape, const float* data);
  void write(const std::string& name, const std::vector<std::int64_t>& shape, const double* data);
  void write(const std::string& name, const std::vector<std::int64_t>& shape, const std::int64_t* data);

  // Root attributes; each key may be written once. Strings are variable-length, so any size fits (the deck text).
  void attr(const std::string& key, const std::string& value);
  void attr(const std::string& key, std::int64_t value);
  void attr(const std::string& key, double value);

  // Publishes the file under `path`. No writes are allowed afterwards.
  void commit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class CheckpointReader {
 public:
  // Errors: missing file, not HDF5, truncated or corrupt, not a mambamoe checkpoint, newer format.
  explicit CheckpointReader(const std::string& path);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  // Whether `name` (with or without a leading '/') is a dataset.
  bool has(const std::string& name) const;
  std::vector<std::int64_t> shape(const std::string& name) const;
  // Dataset names under `group`, recursive, sorted, as full paths without the leading '/'.
  std::vector<std::string> list(const std::string& group = "/") const;

  // Reads the whole dataset into `data`, after checking that its element type matches and its shape equals
  // `expect` (the error names the dataset, both shapes and the file).
  void read(const std::string& name, const std::vector<std::int64_t>& expect, float* data) const;
  void read(const std::string& name, const std::vector<std::int64_t>& expect, double* data) const;
  void read(const std::string& name, const std::vector<std::int64_t>& expect, std::int64_t* data) const;

  bool has_attr(const std::string& key) const;
  std::string attr_string(const std::string& key) const;
  std::int64_t attr_int(const std::string& key) const;
  double attr_double(const std::string& key) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mm::io
