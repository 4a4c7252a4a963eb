// Internal helpers shared by the HDF5 containers (checkpoint.cpp, dataset_h5.cpp): owned handles, a silenced error
// stack, errors that carry HDF5's own reason, files published by atomic rename, and typed attributes. Not part of
// the public API: it includes <hdf5.h>, which the public headers keep out of their users' builds.
#pragma once

#include <fcntl.h>
#include <hdf5.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "core/error.hpp"

namespace mm::io::h5 {

// Owns one HDF5 identifier and releases it with the matching H5?close, so every handle is closed on every path.
class Hid {
 public:
  using Closer = herr_t (*)(hid_t);
  Hid() = default;
  Hid(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  Hid(Hid&& o) noexcept : id_(std::exchange(o.id_, H5I_INVALID_HID)), closer_(o.closer_) {}
  Hid& operator=(Hid&& o) noexcept {
    if (this != &o) {
      close();
      id_ = std::exchange(o.id_, H5I_INVALID_HID);
      closer_ = o.closer_;
    }
    return *this;
  }
  ~Hid() { close(); }

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  // Closes now; false when HDF5 fails, which matters for the file, whose close writes the last metadata.
  bool close() {
    const herr_t rc = valid() ? closer_(id_) : 0;
    id_ = H5I_INVALID_HID;
    return rc >= 0;
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

// HDF5 prints its whole error stack to stderr by default; users should see only our mm::Error. The previous
// handler is restored so that other HDF5 code in the process keeps its own setting.
class QuietHdf5 {
 public:
  QuietHdf5() {
    H5Eget_auto2(H5E_DEFAULT, &func_, &data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~QuietHdf5() { H5Eset_auto2(H5E_DEFAULT, func_, data_); }
  QuietHdf5(const QuietHdf5&) = delete;
  QuietHdf5& operator=(const QuietHdf5&) = delete;

 private:
  H5E_auto2_t func_ = nullptr;
  void* data_ = nullptr;
};

// HDF5's innermost message, where the failure was detected (e.g. "truncated file: eof = ..."), as a suffix for
// ours; the outer frames only repeat "unable to open file" in other words.
inline std::string hdf5_detail() {
  const char* innermost = nullptr;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* err, void* out) -> herr_t {
        if (n == 0) *static_cast<const char**>(out) = err->desc;
        return 0;
      },
      &innermost);
  std::string detail = innermost && *innermost ? std::string(" (HDF5: ") + innermost + ")" : std::string();
  H5Eclear2(H5E_DEFAULT);
  return detail;
}

// mm::require for HDF5 calls: appends HDF5's own reason, and only walks the error stack when the call failed.
template <class... Args>
void h5_require(bool ok, const std::string& path, Args&&... message) {
  if (!ok) throw Error(path, detail::concat(std::forward<Args>(message)..., hdf5_detail()));
}

template <class T>
struct Elem;
template <>
struct Elem<float> {
  static constexpr const char* name = "float32";
  static hid_t type() { return H5T_NATIVE_FLOAT; }
};
template <>
struct Elem<double> {
  static constexpr const char* name = "float64";
  static hid_t type() { return H5T_NATIVE_DOUBLE; }
};
template <>
struct Elem<std::int64_t> {
  static constexpr const char* name = "int64";
  static hid_t type() { return H5T_NATIVE_INT64; }
};
template <>
struct Elem<std::uint8_t> {
  static constexpr const char* name = "uint8";
  static hid_t type() { return H5T_NATIVE_UINT8; }
};

// A stored type in the words the errors use; equal to Elem<T>::name exactly when reading it as T loses nothing
// (same class, width and signedness; HDF5 converts the byte order).
inline std::string type_name(hid_t type) {
  const std::string bits = std::to_string(8 * H5Tget_size(type));
  switch (H5Tget_class(type)) {
    case H5T_FLOAT: return "float" + bits;
    case H5T_INTEGER: return (H5Tget_sign(type) == H5T_SGN_NONE ? "uint" : "int") + bits;
    case H5T_STRING: return H5Tis_variable_str(type) > 0 ? "string" : "fixed-length string";
    default: return "a non-numeric type";
  }
}

inline std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

inline std::string strip_slashes(std::string name) {
  while (name.starts_with('/')) name.erase(0, 1);
  while (name.ends_with('/')) name.pop_back();
  return name;
}

// The extent of dataset `ds` (`name` in the errors); a scalar has rank 0.
inline std::vector<std::int64_t> dataset_shape(hid_t ds, const std::string& path, const std::string& name) {
  const Hid space(H5Dget_space(ds), H5Sclose);
  h5_require(space.valid(), path, "cannot read the shape of dataset '", name, "'");
  const int rank = H5Sget_simple_extent_ndims(space.get());
  h5_require(rank >= 0, path, "cannot read the shape of dataset '", name, "'");
  require(H5Sget_simple_extent_type(space.get()) != H5S_NULL, path, "dataset '", name, "' holds no data");
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  h5_require(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr) >= 0, path,
             "cannot read the shape of dataset '", name, "'");
  return {dims.begin(), dims.end()};
}

// A variable-length string type in character set `cset`; invalid when HDF5 fails.
inline Hid string_type(H5T_cset_t cset) {
  Hid type(H5Tcopy(H5T_C_S1), H5Tclose);
  if (type.valid() && (H5Tset_size(type.get(), H5T_VARIABLE) < 0 || H5Tset_cset(type.get(), cset) < 0)) return {};
  return type;
}

// Whether every link along `name` exists. H5Lexists fails instead of answering false when an intermediate group
// is missing (or is a dataset), so the path is asked one component at a time.
inline bool link_exists(hid_t file, const std::string& name) {
  if (name.empty()) return false;
  for (std::size_t end = name.find('/');; end = name.find('/', end + 1)) {
    if (H5Lexists(file, name.substr(0, end).c_str(), H5P_DEFAULT) <= 0) return false;
    if (end == std::string::npos) return true;
  }
}

// Opens `name` if it exists and is an object of `kind` (H5I_DATASET or H5I_GROUP); an invalid Hid otherwise.
inline Hid open_object(hid_t file, const std::string& name, H5I_type_t kind) {
  if (!link_exists(file, name)) return {};
  Hid obj(H5Oopen(file, name.c_str(), H5P_DEFAULT), H5Oclose);
  return obj.valid() && H5Iget_type(obj.get()) == kind ? std::move(obj) : Hid();
}

// fsync by name: HDF5 leaves the data in the page cache, and without this a power loss after the rename could
// publish a file whose blocks never reached the disk.
inline void sync_file(const std::string& context, const std::string& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  require(fd >= 0, context, "cannot open ", file, " to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  require(rc == 0, context, "cannot sync ", file, ": ", std::strerror(err));
}

// An HDF5 file written under `path + ".tmp"` and published under `path` by commit(), so a crash never leaves a
// half-written file under the real name (an older file there stays intact until then). Destroying an uncommitted
// one removes the temporary file.
class PendingFile {
 public:
  PendingFile() = default;
  PendingFile(const PendingFile&) = delete;
  PendingFile& operator=(const PendingFile&) = delete;
  ~PendingFile() {
    if (!owns_tmp_) return;
    const QuietHdf5 quiet;
    file_.close();
    std::error_code ec;  // best effort: a destructor cannot report, and the next writer truncates a leftover
    std::filesystem::remove(tmp_, ec);
  }

  // Errors name `path`. A .tmp left by a crashed run is truncated: it was never published, so nothing refers to it.
  void create(const std::string& path) {
    const QuietHdf5 quiet;
    require(!path.empty(), path, "the output path is empty");
    path_ = path;
    tmp_ = path + ".tmp";
    file_ = Hid(H5Fcreate(tmp_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    h5_require(file_.valid(), path_, "cannot create the temporary file ", tmp_);
    owns_tmp_ = true;
  }

  hid_t get() const { return file_.get(); }
  // Created and not yet committed.
  bool open() const { return file_.valid(); }
  const std::string& path() const { return path_; }
  const std::string& tmp() const { return tmp_; }

  // Flushes, closes, fsyncs and renames the temporary file onto the path atomically.
  void commit() {
    const QuietHdf5 quiet;
    // Closing a file with objects still open only defers the close, which would then write after the sync.
    const ssize_t open_objects = H5Fget_obj_count(file_.get(), H5F_OBJ_ALL & ~H5F_OBJ_FILE);
    require(open_objects == 0, path_, "cannot publish ", tmp_, ": ", open_objects, " HDF5 objects are still open");
    h5_require(H5Fflush(file_.get(), H5F_SCOPE_GLOBAL) >= 0, path_, "cannot flush ", tmp_);
    h5_require(file_.close(), path_, "cannot close ", tmp_);
    sync_file(path_, tmp_);
    std::error_code ec;
    std::filesystem::rename(tmp_, path_, ec);
    require(!ec, path_, "cannot rename ", tmp_, " onto it: ", ec.message());
    owns_tmp_ = false;
    // Persist the rename itself. Best effort: the data is already safe, and losing the rename in a crash only
    // leaves the previous file in place.
    const std::filesystem::path dir = std::filesystem::path(path_).parent_path();
    const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
      ::fsync(fd);
      ::close(fd);
    }
  }

 private:
  std::string path_, tmp_;
  Hid file_;
  bool owns_tmp_ = false;  // the temporary file is ours to remove (created, not yet renamed)
};

// Opens an existing file read-only with the access properties `fapl`; `what` names its kind in the errors
// ("checkpoint", "dataset"). Errors: missing, not a regular file, not HDF5, truncated or corrupt.
inline Hid open_read_only(const std::string& path, const std::string& what, hid_t fapl = H5P_DEFAULT) {
  namespace fs = std::filesystem;
  const QuietHdf5 quiet;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  require(st.type() != fs::file_type::not_found, path, "no such ", what, " file");
  require(!ec, path, "cannot access the ", what, " file: ", ec.message());
  require(fs::is_regular_file(st), path, "the ", what, " is not a regular file");
#if H5_VERSION_GE(1, 12, 0)
  const htri_t is_hdf5 = H5Fis_accessible(path.c_str(), H5P_DEFAULT);  // H5Fis_hdf5 is deprecated from 1.12
#else
  const htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
#endif
  h5_require(is_hdf5 >= 0, path, "cannot read the ", what, " file");
  require(is_hdf5 > 0, path, "not an HDF5 file");
  // A truncated file fails here: the superblock records the end of file, and HDF5 compares it with the size.
  Hid file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl), H5Fclose);
  h5_require(file.valid(), path, "cannot open the HDF5 file (is it truncated or corrupt?)");
  return file;
}

// Creates attribute `key` of `obj` with shape `dims` (empty: a scalar) and writes `value`, of memory type `type`.
inline void write_attr(hid_t obj, const std::string& path, const std::string& key, hid_t type, const void* value,
                       const std::vector<hsize_t>& dims = {}) {
  const Hid space = dims.empty() ? Hid(H5Screate(H5S_SCALAR), H5Sclose)
                                 : Hid(H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose);
  h5_require(space.valid(), path, "attribute '", key, "': cannot make a dataspace");
  const Hid a(H5Acreate2(obj, key.c_str(), type, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  h5_require(a.valid(), path, "cannot create attribute '", key, "'");
  h5_require(H5Awrite(a.get(), type, value) >= 0, path, "cannot write attribute '", key, "'");
}

// A variable-length UTF-8 string attribute. Such strings live in the global heap, so they escape the 64 kB limit
// on attributes stored in the object header; a NUL would silently cut them short.
inline void write_string_attr(hid_t obj, const std::string& path, const std::string& key, const std::string& value) {
  require(value.find('\0') == std::string::npos, path, "attribute '", key, "': the string contains a NUL");
  const Hid type = string_type(H5T_CSET_UTF8);
  h5_require(type.valid(), path, "attribute '", key, "': cannot make a string type");
  const char* text = value.c_str();
  write_attr(obj, path, key, type.get(), &text);
}

// The scalar attribute `key` of `obj`, checked to be stored as `want` (a type_name); `where` names `obj` in the
// errors ("the checkpoint").
inline Hid scalar_attr(hid_t obj, const std::string& path, const std::string& key, const std::string& want,
                       const std::string& where) {
  const htri_t exists = H5Aexists(obj, key.c_str());
  h5_require(exists >= 0, path, "cannot look up attribute '", key, "'");
  require(exists > 0, path, "no attribute '", key, "' in ", where);
  Hid a(H5Aopen(obj, key.c_str(), H5P_DEFAULT), H5Aclose);
  h5_require(a.valid(), path, "cannot open attribute '", key, "'");
  const Hid type(H5Aget_type(a.get()), H5Tclose);
  h5_require(type.valid(), path, "cannot read the type of attribute '", key, "'");
  const std::string stored = type_name(type.get());
  require(stored == want, path, "attribute '", key, "' is stored as ", stored, ", read as ", want);
  const Hid space(H5Aget_space(a.get()), H5Sclose);
  h5_require(space.valid(), path, "cannot read the shape of attribute '", key, "'");
  require(H5Sget_simple_extent_type(space.get()) == H5S_SCALAR, path, "attribute '", key, "' is not a scalar");
  return a;
}

template <class T>
T read_scalar_attr(hid_t obj, const std::string& path, const std::string& key, const std::string& where) {
  const QuietHdf5 quiet;
  const Hid a = scalar_attr(obj, path, key, Elem<T>::name, where);
  T value{};
  h5_require(H5Aread(a.get(), Elem<T>::type(), &value) >= 0, path, "cannot read attribute '", key, "'");
  return value;
}

inline std::string read_string_attr(hid_t obj, const std::string& path, const std::string& key,
                                    const std::string& where) {
  const QuietHdf5 quiet;
  const Hid a = scalar_attr(obj, path, key, "string", where);
  const Hid stored(H5Aget_type(a.get()), H5Tclose);
  // Read in the stored character set: HDF5 does not convert between ASCII and UTF-8.
  const Hid type = stored.valid() ? string_type(H5Tget_cset(stored.get())) : Hid();
  h5_require(type.valid(), path, "attribute '", key, "': cannot make a string type");
  char* text = nullptr;
  h5_require(H5Aread(a.get(), type.get(), &text) >= 0, path, "cannot read attribute '", key, "'");
  const std::unique_ptr<char, herr_t (*)(void*)> owned(text, H5free_memory);
  return text ? std::string(text) : std::string();
}

}  // namespace mm::io::h5
