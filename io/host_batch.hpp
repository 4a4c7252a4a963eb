// One micro-batch of token windows on the host, rows b * seqlen + t: input tokens, next-token targets (-1: not
// scored) and record ids (packed records never see each other).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace mm::io {

struct HostBatch {
  HostBatch() = default;
  HostBatch(std::int64_t b, std::int64_t l)
      : batch(b), seqlen(l), tokens(std::size_t(b * l)), targets(std::size_t(b * l)), seq_idx(std::size_t(b * l)) {}
  std::int64_t batch = 0, seqlen = 0;
  std::vector<std::int32_t> tokens, targets, seq_idx;
  std::int64_t scored() const {  // number of targets >= 0
    return std::count_if(targets.begin(), targets.end(), [](std::int32_t t) { return t >= 0; });
  }
};

}  // namespace mm::io
