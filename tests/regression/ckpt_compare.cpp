// ckpt_compare a.h5 b.h5: exit 0 when two checkpoints hold the same datasets with the same shapes and bit-identical
// contents (float32 tensors, as the trainer writes them) and the same step; otherwise print the first difference
// and exit 1. Attributes other than the step (the deck, the git hash) are not compared.
#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

#include "io/checkpoint.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: ckpt_compare a.h5 b.h5\n");
    return 2;
  }
  try {
    mm::io::CheckpointReader a(argv[1]), b(argv[2]);
    const auto names = a.list(), names_b = b.list();
    if (names != names_b) {
      std::printf("different dataset lists (%zu vs %zu)\n", names.size(), names_b.size());
      return 1;
    }
    if (a.attr_int("step") != b.attr_int("step")) {
      std::printf("different steps: %lld vs %lld\n", (long long)a.attr_int("step"), (long long)b.attr_int("step"));
      return 1;
    }
    std::size_t elements = 0;
    for (const auto& n : names) {
      const auto shape = a.shape(n);
      if (shape != b.shape(n)) {
        std::printf("%s: different shapes\n", n.c_str());
        return 1;
      }
      std::size_t count = 1;
      for (auto e : shape) count *= std::size_t(e);
      std::vector<float> x(count), y(count);
      a.read(n, shape, x.data());
      b.read(n, shape, y.data());
      for (std::size_t i = 0; i < count; ++i)
        if (std::memcmp(&x[i], &y[i], sizeof(float)) != 0) {
          std::printf("%s[%zu]: %.9g vs %.9g\n", n.c_str(), i, double(x[i]), double(y[i]));
          return 1;
        }
      elements += count;
    }
    std::printf("identical: %zu datasets, %zu values, step %lld\n", names.size(), elements,
                (long long)a.attr_int("step"));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt_compare: %s\n", e.what());
    return 2;
  }
}
