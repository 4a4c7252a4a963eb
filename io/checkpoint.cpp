// HDF5 (serial C API, 1.10+) implementation of the checkpoint container; see checkpoint.hpp for the layout.
#include "io/checkpoint.hpp"

#include <algorithm>
#include <exception>
#include <utility>

#include "core/error.hpp"
#include "io/h5util.hpp"

namespace mm::io {

using namespace h5;

// ================================================================================================== writer

struct CheckpointWriter::Impl {
  std::string path;
  PendingFile out;

  void require_open(const std::string& what) const {
    require(out.open(), path, "cannot write ", what, ": the writer was already committed");
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
    require(!link_exists(out.get(), n), path, "dataset '", n, "': the name is already in the checkpoint");
    // HDF5's own reason for a dataset in the way of a group ("message type not found") would say nothing.
    for (std::size_t end = n.find('/'); end != std::string::npos; end = n.find('/', end + 1)) {
      const std::string parent = n.substr(0, end);
      require(!link_exists(out.get(), parent) || open_object(out.get(), parent, H5I_GROUP).valid(), path,
              "dataset '", n, "': '", parent, "' is a dataset, not a group");
    }

    Hid space = shape.empty() ? Hid(H5Screate(H5S_SCALAR), H5Sclose)
                              : Hid(H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose);
    h5_require(space.valid(), path, "dataset '", n, "': cannot make a dataspace of shape ", shape_str(shape));
    Hid lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
    h5_require(lcpl.valid() && H5Pset_create_intermediate_group(lcpl.get(), 1) >= 0, path, "dataset '", n,
               "': cannot set up group creation");
    Hid ds(H5Dcreate2(out.get(), n.c_str(), Elem<T>::type(), space.get(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT),
           H5Dclose);
    h5_require(ds.valid(), path, "cannot create dataset '", n, "'");
    // An empty tensor has nothing to write (and its data pointer may be null).
    if (count > 0) {
      h5_require(H5Dwrite(ds.get(), Elem<T>::type(), H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0, path,
                 "cannot write dataset '", n, "'");
    }
  }

  // Checks that root attribute `key` may be written: the writer is open and the key is new.
  void require_new_attr(const std::string& key) const {
    require_open("attribute '" + key + "'");
    require(!key.empty(), path, "attribute names must not be empty");
    const htri_t exists = H5Aexists(out.get(), key.c_str());
    h5_require(exists >= 0, path, "cannot look up attribute '", key, "'");
    require(exists == 0, path, "attribute '", key, "' is already in the checkpoint");
  }
};

CheckpointWriter::CheckpointWriter(const std::string& path) : impl_(std::make_unique<Impl>()) {
  require(!path.empty(), path, "the checkpoint path is empty");
  impl_->path = path;
  impl_->out.create(path);
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

// Variable-length, so the deck text fits however long it is.
void CheckpointWriter::attr(const std::string& key, const std::string& value) {
  const QuietHdf5 quiet;
  impl_->require_new_attr(key);
  write_string_attr(impl_->out.get(), impl_->path, key, value);
}
void CheckpointWriter::attr(const std::string& key, std::int64_t value) {
  const QuietHdf5 quiet;
  impl_->require_new_attr(key);
  write_attr(impl_->out.get(), impl_->path, key, H5T_NATIVE_INT64, &value);
}
void CheckpointWriter::attr(const std::string& key, double value) {
  const QuietHdf5 quiet;
  impl_->require_new_attr(key);
  write_attr(impl_->out.get(), impl_->path, key, H5T_NATIVE_DOUBLE, &value);
}

void CheckpointWriter::commit() {
  require(impl_->out.open(), impl_->path, "the checkpoint was already committed");
  impl_->out.commit();
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

  template <class T>
  void read(const std::string& name, const std::vector<std::int64_t>& expect, T* data) const {
    const QuietHdf5 quiet;
    const std::string n = strip_slashes(name);
    const Hid ds = dataset(n);
    const Hid type(H5Dget_type(ds.get()), H5Tclose);
    h5_require(type.valid(), path, "cannot read the type of dataset '", n, "'");
    const std::string stored = type_name(type.get());
    require(stored == Elem<T>::name, path, "dataset '", n, "' is stored as ", stored, ", read as ", Elem<T>::name);
    const std::vector<std::int64_t> got = dataset_shape(ds.get(), path, n);
    if (got != expect) {
      throw Error(path, detail::concat("dataset '", n, "' has shape ", shape_str(got), ", expected ",
                                       shape_str(expect)));
    }
    if (std::find(got.begin(), got.end(), 0) == got.end()) {
      h5_require(H5Dread(ds.get(), Elem<T>::type(), H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0, path,
                 "cannot read dataset '", n, "'");
    }
  }

};

CheckpointReader::CheckpointReader(const std::string& path) : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->file = open_read_only(path, "checkpoint");
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
  return dataset_shape(impl_->dataset(n).get(), impl_->path, n);
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
  return read_string_attr(impl_->file.get(), impl_->path, key, "the checkpoint");
}

std::int64_t CheckpointReader::attr_int(const std::string& key) const {
  return read_scalar_attr<std::int64_t>(impl_->file.get(), impl_->path, key, "the checkpoint");
}

double CheckpointReader::attr_double(const std::string& key) const {
  return read_scalar_attr<double>(impl_->file.get(), impl_->path, key, "the checkpoint");
}

}  // namespace mm::io
