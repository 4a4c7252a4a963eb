// Parameter registry: every parameter of a model lives in one flat buffer (and its gradient in a second one), as a
// named slice with a global shape. One buffer keeps the optimizer, the gradient norm, the all-reduce of gradients
// and checkpointing to one kernel or one loop each; names and shapes are what checkpoints store.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/kokkos_types.hpp"
#include "core/rng.hpp"

namespace mm {

// How a parameter is initialised (drawn with the counter RNG from (seed, hash(name), element index), so the values
// do not depend on the backend, the thread count or how the model is later sharded).
struct Init {
  enum Kind { zeros, ones, constant, uniform, normal, dt_bias, a_log, log_column } kind = zeros;
  double a = 0, b = 0;   // uniform: [a, b); normal: mean a, std b; constant: a; a_log: U[a, b]; dt_bias: see init.cpp;
                         // log_column: element k of a row-major (., a) matrix is log(k % a + 1) (no draw)
  double c = 0;          // dt_bias: floor
  double scale = 1;      // applied after drawing (out_proj rescaling by 1/sqrt(n_layer))
  static Init Zeros() { return {zeros}; }
  static Init Ones() { return {ones}; }
  static Init Uniform(double lo, double hi, double scale = 1) { return {uniform, lo, hi, 0, scale}; }
  static Init Normal(double mean, double std) { return {normal, mean, std}; }
  static Init DtBias(double dt_min, double dt_max, double floor) { return {dt_bias, dt_min, dt_max, floor}; }
  static Init ALog(double lo, double hi) { return {a_log, lo, hi}; }
  // Mamba-1's A_log(d, n) = log(n + 1) for a matrix of `cols` columns (S4D-real initialisation).
  static Init LogColumn(index_t cols) { return {log_column, double(cols)}; }
};

// How a parameter's local slice maps onto the unsharded tensor under tensor or expert parallelism. The tensor is
// seen as a matrix of rows = shape[0] and cols = the product of the other dimensions; the local rows are the
// concatenation of the global row ranges in `rows`, the local columns that of `cols` (empty: all of them), so local
// element (i, j) is global element (rows[i], cols[j]). Checkpoints store the unsharded tensor (any layout loads any
// checkpoint) and initialisation draws by global element index (a sharded model starts as the slices of the
// unsharded one).
struct IndexRange {
  index_t begin = 0, count = 0;
};
enum class Split {
  none,  // every rank of the tp and ep groups holds the whole tensor
  tp,    // sliced over the tensor-parallel ranks (replicated over ep)
  ep,    // sliced over the expert-parallel ranks (replicated over tp)
  tp_ep  // sliced over both (expert weights under tp and ep)
};
struct Shard {
  Split split = Split::none;
  std::vector<index_t> global_shape;  // empty: not sharded (the local shape)
  std::vector<IndexRange> rows, cols;
};

struct ParamEntry {
  std::string name;
  std::vector<index_t> shape;        // local shape
  index_t offset = 0, size = 0;
  bool decay = false;  // AdamW weight decay applies (matrices); not for norms, biases, A_log, D, dt_bias
  Init init;
  Shard shard;

  bool sharded() const { return !shard.global_shape.empty(); }
  const std::vector<index_t>& global_shape() const { return sharded() ? shard.global_shape : shape; }
  index_t global_size() const {
    index_t n = 1;
    for (index_t d : global_shape()) n *= d;
    return n;
  }
  // The global flat (row-major) index of every local element, in local order.
  std::vector<index_t> global_index() const;
};

template <class P>
class ParamStore {
 public:
  // Declare a parameter before allocate(); returns its index.
  // `shard` (optional) says which slice of the unsharded tensor `shape` is (see Shard).
  std::size_t add(const std::string& name, std::vector<index_t> shape, bool decay, Init init, Shard shard = {}) {
    require(!allocated(), "ParamStore", "parameter '", name, "' added after allocation");
    require(!index_.count(name), "ParamStore", "duplicate parameter name '", name, "'");
    ParamEntry e;
    e.name = name;
    e.shape = std::move(shape);
    e.size = 1;
    for (index_t d : e.shape) e.size *= d;
    e.offset = total_;
    e.decay = decay;
    e.init = init;
    e.shard = std::move(shard);
    if (e.sharded()) check_shard(e);
    // keep every slice 64-byte aligned for vector loads
    total_ += (e.size + 15) / 16 * 16;
    index_[name] = entries_.size();
    entries_.push_back(e);
    return entries_.size() - 1;
  }

  void allocate() {
    values_ = View1<P>("params::values", total_);
    grads_ = View1<P>("params::grads", total_);
    allocated_ = true;
  }
  bool allocated() const { return allocated_; }

  // Initialise every parameter from (seed, name).
  void initialize(std::uint64_t seed);

  // on the execution space's stream: no device-wide fence before and after, as the plain deep_copy has
  void zero_grads() { Kokkos::deep_copy(Exec(), grads_, P(0)); }

  const std::vector<ParamEntry>& entries() const { return entries_; }
  const ParamEntry& entry(const std::string& name) const { return entries_[index(name)]; }
  bool has(const std::string& name) const { return index_.count(name) > 0; }
  std::size_t index(const std::string& name) const {
    auto it = index_.find(name);
    require(it != index_.end(), "ParamStore", "no parameter named '", name, "'");
    return it->second;
  }
  index_t total() const { return total_; }
  index_t count() const {
    index_t n = 0;
    for (const auto& e : entries_) n += e.size;
    return n;
  }
  // The unsharded model's elements (count() is this rank's slices under tp / ep).
  index_t global_count() const {
    index_t n = 0;
    for (const auto& e : entries_) n += e.global_size();
    return n;
  }

  const View1<P>& values() const { return values_; }
  const View1<P>& grads() const { return grads_; }

  // Views of one parameter (value or gradient) with its shape.
  View1<P> v1(std::size_t i) const { return slice1(values_, i); }
  View2<P> v2(std::size_t i) const { return slice2(values_, i); }
  View1<P> g1(std::size_t i) const { return slice1(grads_, i); }
  View2<P> g2(std::size_t i) const { return slice2(grads_, i); }

 private:
  static void check_shard(const ParamEntry& e);
  View1<P> slice1(const View1<P>& buf, std::size_t i) const {
    const auto& e = entries_[i];
    return View1<P>(buf.data() + e.offset, e.size);
  }
  View2<P> slice2(const View1<P>& buf, std::size_t i) const {
    const auto& e = entries_[i];
    require(e.shape.size() == 2, "ParamStore", "parameter '", e.name, "' is not a matrix");
    return View2<P>(buf.data() + e.offset, e.shape[0], e.shape[1]);
  }

  std::vector<ParamEntry> entries_;
  std::map<std::string, std::size_t> index_;
  index_t total_ = 0;
  bool allocated_ = false;
  View1<P> values_, grads_;
};

}  // namespace mm
