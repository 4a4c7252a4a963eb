// HDF5 (serial C API, 1.10+) implementation of the checkpoint container; see checkpoint.hpp for the layout.
#include "io/checkpoint.hpp"

#include <fcntl.h>
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <system_error>
#include <utility>

#include "core/error.hpp"

namespace mm::io {
namespace {

namespace fs = std::filesystem;

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
std::string hdf5_detail() {
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

// A stored type in the words the errors use; equal to Elem<T>::name exactly when reading it as T loses nothing
// (same class, width and signedness; HDF5 converts the byte order).
std::string type_name(hid_t type) {
  const std::string bits = std::to_string(8 * H5Tget_size(type));
  switch (H5Tget_class(type)) {
    case H5T_FLOAT: return "float" + bits;
    case H5T_INTEGER: return (H5Tget_sign(type) == H5T_SGN_NONE ? "uint" : "int") + bits;
    case H5T_STRING: return H5Tis_variable_str(type) > 0 ? "string" : "fixed-length string";
    default: return "a non-numeric type";
  }
}

std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string strip_slashes(std::string name) {
  while (name.starts_with('/')) name.erase(0, 1);
  while (name.ends_with('/')) name.pop_back();
  return name;
}

// Whether every link along `name` exists. H5Lexists fails instead of answering false when an intermediate group
// is missing (or is a dataset), so the path is asked one component at a time.
bool link_exists(hid_t file, const std::string& name) {
  if (name.empty()) return false;
  for (std::size_t end = name.find('/');; end = name.find('/', end + 1)) {
    if (H5Lexists(file, name.substr(0, end).c_str(), H5P_DEFAULT) <= 0) return false;
    if (end == std::string::npos) return true;
  }
}

// Opens `name` if it exists and is an object of `kind` (H5I_DATASET or H5I_GROUP); an invalid Hid otherwise.
Hid open_object(hid_t file, const std::string& name, H5I_type_t kind) {
  if (!link_exists(file, name)) return {};
  Hid obj(H5Oopen(file, name.c_str(), H5P_DEFAULT), H5Oclose);
  return obj.valid() && H5Iget_type(obj.get()) == kind ? std::move(obj) : Hid();
}

// fsync by name: HDF5 leaves the data in the page cache, and without this a power loss after the rename could
// publish a checkpoint whose blocks never reached the disk.
void sync_file(const std::string& context, const std::string& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  require(fd >= 0, context, "cannot open ", file, " to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  require(rc == 0, context, "cannot sync ", file, ": ", std::strerror(err));
}

}  // namespace

// ================================================================================================== writer

struct CheckpointWriter::Impl {
  std::string path, tmp;
  Hid file;
  bool owns_tmp = false;  // the temporary file is ours to remove (created, not yet renamed)

  ~Impl() {
    if (!owns_tmp) return;
    const QuietHdf5 quiet;
    file.close();
    std::error_code ec;  // best effort: a destructor cannot report, and the next writer truncates a leftover
    fs::remove(tmp, ec);
  }

  void require_open(const std::string& what) const {
    require(file.valid(), path, "cannot write ", what, ": the writer was already committed");
  }

  // The name as stored: no leading '/', and no empty or "." components, which HDF5 would silently collapse so
  // that list() would not give the name back.
  std::string dataset_name(const std::string& name) const {
    const std::string n = name.starts_with('/') ? name.substr(1) : name;
    bool ok = !n.empty();
    for (std::size_t begin = 0; ok;) {
      const std::size_t end = n.find('/', begin);
      const std::string part = n.substr(begin, end - begin);
      ok = !part.empty() && part != ".";
      if (end == std::string::npos) break;
      begin = end + 1;
    }
    require(ok, path, "invalid dataset name '", name, "': need non-empty '/'-separated components");
    return n;
  }

  template <class T>
  void write(const std::string& name, const std::vector<std::int64_t>& shape, const T* data) {
    const QuietHdf5 quiet;
    require_open("dataset '" + name + "'");
    const std::string n = dataset_name(name);
    std::vector<hsize_t> dims;
    hsize_t count = 1;
    for (const std::int64_t d : shape) {
      require(d >= 0, path, "dataset '", n, "': negative dimension in shape ", shape_str(shape));
      dims.push_back(hsize_t(d));
      count *= hsize_t(d);
    }
    require(data != nullptr || count == 0, path, "dataset '", n, "': no data for shape ", shape_str(shape));
    require(!link_exists(file.get(), n), path, "dataset '", n, "': the name is already in the checkpoint");
    // HDF5's own reason for a dataset in the way of a group ("message type not found") would say nothing.
    for (std::size_t end = n.find('/'); end != std::string::npos; end = n.find('/', end + 1)) {
      const std::string parent = n.substr(0, end);
      require(!link_exists(file.get(), parent) || open_object(file.get(), parent, H5I_GROUP).valid(), path,
              "dataset '", n, "': '", parent, "' is a dataset, not a group");
    }

    Hid space = shape.empty() ? Hid(H5Screate(H5S_SCALAR), H5Sclose)
                              : Hid(H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose);
    h5_require(space.valid(), path, "dataset '", n, "': cannot make a dataspace of shape ", shape_str(shape));
    Hid lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
    h5_require(lcpl.valid() && H5Pset_create_intermediate_group(lcpl.get(), 1) >= 0, path, "dataset '", n,
               "': cannot set up group creation");
    Hid ds(H5Dcreate2(file.get(), n.c_str(), Elem<T>::type(), space.get(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT),
           H5Dclose);
    h5_require(ds.valid(), path, "cannot create dataset '", n, "'");
    // An empty tensor has nothing to write (and its data pointer may be null).
    if (count > 0) {
      h5_require(H5Dwrite(ds.get(), Elem<T>::type(), H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0, path,
                 "cannot write dataset '", n, "'");
    }
  }

  // A scalar root attribute of `type`, whose value is at `value`.
  void attr(const std::string& key, hid_t type, const void* value) {
    const QuietHdf5 quiet;
    require_open("attribute '" + key + "'");
    require(!key.empty(), path, "attribute names must not be empty");
    const htri_t exists = H5Aexists(file.get(), key.c_str());
    h5_require(exists >= 0, path, "cannot look up attribute '", key, "'");
    require(exists == 0, path, "attribute '", key, "' is already in the checkpoint");
    Hid space(H5Screate(H5S_SCALAR), H5Sclose);
    h5_require(space.valid(), path, "attribute '", key, "': cannot make a scalar dataspace");
    Hid a(H5Acreate2(file.get(), key.c_str(), type, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
    h5_require(a.valid(), path, "cannot create attribute '", key, "'");
    h5_require(H5Awrite(a.get(), type, value) >= 0, path, "cannot write attribute '", key, "'");
  }
};

CheckpointWriter::CheckpointWriter(const std::string& path) : impl_(std::make_unique<Impl>()) {
  const QuietHdf5 quiet;
  Impl& w = *impl_;
  require(!path.empty(), path, "the checkpoint path is empty");
  w.path = path;
  w.tmp = path + ".tmp";
  // A .tmp left by a crashed run is truncated: it was never published, so nothing refers to it.
  w.file = Hid(H5Fcreate(w.tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
  h5_require(w.file.valid(), path, "cannot create the temporary file ", w.tmp);
  w.owns_tmp = true;
  attr(kCheckpointFormatAttr, kCheckpointFormat);
}

CheckpointWriter::~CheckpointWriter() = default;

void CheckpointWriter::write(const std::string& name, const std::vector<std::int64_t>& shape, const float* data) {
  impl_->write(name, shape, data);
}
void CheckpointWriter::write(const std::string& name, const std::vector<std::int64_t>& shape, const double* data) {
  impl_->write(name, shape, data);
}
void CheckpointWriter::write(const std::string& name, const std::vector<std::int64_t>& shape,
                             const std::int64_t* data) {
  impl_->write(name, shape, data);
}

void CheckpointWriter::attr(const std::string& key, const std::string& value) {
  // Variable-length strings live in the global heap, so they escape the 64 kB limit on attributes stored in the
  // object header (the deck text can be larger); a NUL would silently cut them short.
  require(value.find('\0') == std::string::npos, impl_->path, "attribute '", key, "': the string contains a NUL");
  const QuietHdf5 quiet;
  Hid type(H5Tcopy(H5T_C_S1), H5Tclose);
  h5_require(type.valid() && H5Tset_size(type.get(), H5T_VARIABLE) >= 0 &&
                 H5Tset_cset(type.get(), H5T_CSET_UTF8) >= 0,
             impl_->path, "attribute '", key, "': cannot make a string type");
  const char* text = value.c_str();
  impl_->attr(key, type.get(), &text);
}
void CheckpointWriter::attr(const std::string& key, std::int64_t value) {
  impl_->attr(key, H5T_NATIVE_INT64, &value);
}
void CheckpointWriter::attr(const std::string& key, double value) { impl_->attr(key, H5T_NATIVE_DOUBLE, &value); }

void CheckpointWriter::commit() {
  const QuietHdf5 quiet;
  Impl& w = *impl_;
  require(w.file.valid(), w.path, "the checkpoint was already committed");
  h5_require(H5Fflush(w.file.get(), H5F_SCOPE_GLOBAL) >= 0, w.path, "cannot flush ", w.tmp);
  h5_require(w.file.close(), w.path, "cannot close ", w.tmp);
  sync_file(w.path, w.tmp);
  std::error_code ec;
  fs::rename(w.tmp, w.path, ec);
  require(!ec, w.path, "cannot rename ", w.tmp, " onto it: ", ec.message());
  w.owns_tmp = false;
  // Persist the rename itself. Best effort: the data is already safe, and losing the rename in a crash only
  // leaves the previous checkpoint in place.
  const fs::path dir = fs::path(w.path).parent_path();
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// ================================================================================================== reader

struct CheckpointReader::Impl {
  std::string path;
  Hid file;

  Hid dataset(const std::string& name) const {
    const std::string n = strip_slashes(name);
    Hid ds = open_object(file.get(), n, H5I_DATASET);
    require(ds.valid(), path, "no dataset '", n, "' in the checkpoint");
    return ds;
  }

  std::vector<std::int64_t> shape(hid_t ds, const std::string& name) const {
    Hid space(H5Dget_space(ds), H5Sclose);
    h5_require(space.valid(), path, "cannot read the shape of dataset '", name, "'");
    const int rank = H5Sget_simple_extent_ndims(space.get());
    h5_require(rank >= 0, path, "cannot read the shape of dataset '", name, "'");
    require(H5Sget_simple_extent_type(space.get()) != H5S_NULL, path, "dataset '", name, "' holds no data");
    std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
    h5_require(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr) >= 0, path,
               "cannot read the shape of dataset '", name, "'");
    return {dims.begin(), dims.end()};
  }

  template <class T>
  void read(const std::string& name, const std::vector<std::int64_t>& expect, T* data) const {
    const QuietHdf5 quiet;
    const std::string n = strip_slashes(name);
    const Hid ds = dataset(n);
    const Hid type(H5Dget_type(ds.get()), H5Tclose);
    h5_require(type.valid(), path, "cannot read the type of dataset '", n, "'");
    const std::string stored = type_name(type.get());
    require(stored == Elem<T>::name, path, "dataset '", n, "' is stored as ", stored, ", read as ", Elem<T>::name);
    const std::vector<std::int64_t> got = shape(ds.get(), n);
    if (got != expect) {
      throw Error(path, detail::concat("dataset '", n, "' has shape ", shape_str(got), ", expected ",
                                       shape_str(expect)));
    }
    if (std::find(got.begin(), got.end(), 0) == got.end()) {
      h5_require(H5Dread(ds.get(), Elem<T>::type(), H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0, path,
                 "cannot read dataset '", n, "'");
    }
  }

  // The scalar root attribute `key`, checked to be stored as `want` (a type_name).
  Hid attribute(const std::string& key, const std::string& want) const {
    const htri_t exists = H5Aexists(file.get(), key.c_str());
    h5_require(exists >= 0, path, "cannot look up attribute '", key, "'");
    require(exists > 0, path, "no attribute '", key, "' in the checkpoint");
    Hid a(H5Aopen(file.get(), key.c_str(), H5P_DEFAULT), H5Aclose);
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
  T scalar(const std::string& key) const {
    const QuietHdf5 quiet;
    const Hid a = attribute(key, Elem<T>::name);
    T value{};
    h5_require(H5Aread(a.get(), Elem<T>::type(), &value) >= 0, path, "cannot read attribute '", key, "'");
    return value;
  }
};

CheckpointReader::CheckpointReader(const std::string& path) : impl_(std::make_unique<Impl>()) {
  const QuietHdf5 quiet;
  Impl& r = *impl_;
  r.path = path;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  require(st.type() != fs::file_type::not_found, path, "no such checkpoint file");
  require(!ec, path, "cannot access the checkpoint file: ", ec.message());
  require(fs::is_regular_file(st), path, "the checkpoint is not a regular file");
#if H5_VERSION_GE(1, 12, 0)
  const htri_t is_hdf5 = H5Fis_accessible(path.c_str(), H5P_DEFAULT);  // H5Fis_hdf5 is deprecated from 1.12
#else
  const htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
#endif
  h5_require(is_hdf5 >= 0, path, "cannot read the checkpoint file");
  require(is_hdf5 > 0, path, "not an HDF5 file");
  // A truncated file fails here: the superblock records the end of file, and HDF5 compares it with the size.
  r.file = Hid(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  h5_require(r.file.valid(), path, "cannot open the HDF5 file (is it truncated or corrupt?)");
  require(has_attr(kCheckpointFormatAttr), path, "not a mambamoe checkpoint: the root attribute '",
          kCheckpointFormatAttr, "' is missing");
  const std::int64_t format = attr_int(kCheckpointFormatAttr);
  require(format <= kCheckpointFormat, path, "checkpoint format ", format, " (attribute '", kCheckpointFormatAttr,
          "') is newer than this build reads (", kCheckpointFormat, "): use a newer mambamoe");
  require(format >= 1, path, "invalid checkpoint format ", format, " in attribute '", kCheckpointFormatAttr, "'");
}

CheckpointReader::~CheckpointReader() = default;

bool CheckpointReader::has(const std::string& name) const {
  const QuietHdf5 quiet;
  return open_object(impl_->file.get(), strip_slashes(name), H5I_DATASET).valid();
}

std::vector<std::int64_t> CheckpointReader::shape(const std::string& name) const {
  const QuietHdf5 quiet;
  const std::string n = strip_slashes(name);
  return impl_->shape(impl_->dataset(n).get(), n);
}

std::vector<std::string> CheckpointReader::list(const std::string& group) const {
  const QuietHdf5 quiet;
  const Impl& r = *impl_;
  const std::string g = strip_slashes(group);
  const Hid grp = g.empty() ? Hid(H5Gopen2(r.file.get(), "/", H5P_DEFAULT), H5Gclose)
                            : open_object(r.file.get(), g, H5I_GROUP);
  require(grp.valid(), r.path, "no group '", g, "' in the checkpoint");

  struct Visit {
    std::string prefix;
    std::vector<std::string> names;
    std::exception_ptr error;  // exceptions must not unwind through HDF5's C frames
  } visit{g.empty() ? g : g + "/", {}, nullptr};
  const auto on_link = [](hid_t at, const char* name, const H5L_info_t*, void* op) -> herr_t {
    auto& v = *static_cast<Visit*>(op);
    try {
      if (open_object(at, name, H5I_DATASET).valid()) v.names.push_back(v.prefix + name);
      return 0;
    } catch (...) {
      v.error = std::current_exception();
      return -1;
    }
  };
  const herr_t rc = H5Lvisit(grp.get(), H5_INDEX_NAME, H5_ITER_INC, on_link, &visit);
  if (visit.error) std::rethrow_exception(visit.error);
  h5_require(rc >= 0, r.path, "cannot list group '", g.empty() ? "/" : g, "'");
  std::sort(visit.names.begin(), visit.names.end());
  return visit.names;
}

void CheckpointReader::read(const std::string& name, const std::vector<std::int64_t>& expect, float* data) const {
  impl_->read(name, expect, data);
}
void CheckpointReader::read(const std::string& name, const std::vector<std::int64_t>& expect, double* data) const {
  impl_->read(name, expect, data);
}
void CheckpointReader::read(const std::string& name, const std::vector<std::int64_t>& expect,
                            std::int64_t* data) const {
  impl_->read(name, expect, data);
}

bool CheckpointReader::has_attr(const std::string& key) const {
  const QuietHdf5 quiet;
  return !key.empty() && H5Aexists(impl_->file.get(), key.c_str()) > 0;
}

std::string CheckpointReader::attr_string(const std::string& key) const {
  const QuietHdf5 quiet;
  const Impl& r = *impl_;
  const Hid a = r.attribute(key, "string");
  const Hid stored(H5Aget_type(a.get()), H5Tclose);
  // Read in the stored character set: HDF5 does not convert between ASCII and UTF-8.
  Hid type(H5Tcopy(H5T_C_S1), H5Tclose);
  h5_require(stored.valid() && type.valid() && H5Tset_size(type.get(), H5T_VARIABLE) >= 0 &&
                 H5Tset_cset(type.get(), H5Tget_cset(stored.get())) >= 0,
             r.path, "attribute '", key, "': cannot make a string type");
  char* text = nullptr;
  h5_require(H5Aread(a.get(), type.get(), &text) >= 0, r.path, "cannot read attribute '", key, "'");
  const std::unique_ptr<char, herr_t (*)(void*)> owned(text, H5free_memory);
  return text ? std::string(text) : std::string();
}

std::int64_t CheckpointReader::attr_int(const std::string& key) const { return impl_->scalar<std::int64_t>(key); }

double CheckpointReader::attr_double(const std::string& key) const { return impl_->scalar<double>(key); }

}  // namespace mm::io
