// File helpers for the I/O tests: a scratch directory per test, and the message of the mm::Error a call throws.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "core/error.hpp"

namespace mmtest {

// A fresh directory, unique to this process (pid) and this instance, removed with everything in it.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "") {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("mambamoe_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + "_" + tag);
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }

  std::string path() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  // Writes `content` byte for byte and returns the file's path.
  std::string write(const std::string& name, const std::string& content) const {
    const std::string p = file(name);
    std::ofstream(p, std::ios::binary) << content;
    return p;
  }
  // The names in the directory, sorted.
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::filesystem::path path_;
};

// The message of the mm::Error that `f` throws; the test fails when it throws nothing.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const mm::Error& e) {
    return e.what();
  }
  FAIL("no mm::Error was thrown");
  return {};
}

}  // namespace mmtest
