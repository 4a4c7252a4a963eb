#include "io/fasta.hpp"

#include <htslib/bgzf.h>
#include <htslib/hts.h>
#include <htslib/kstring.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string_view>
#include <system_error>
#include <unordered_map>

#include "core/error.hpp"

namespace mm::io {
namespace {

// What each byte of a sequence line becomes: a normalised base, nothing (whitespace), or an error. One table
// lookup per byte keeps a 10^8-base genome at a fraction of a second on top of decompression.
constexpr char kInvalid = 0;
constexpr char kSkip = 1;

constexpr std::array<char, 256> make_base_table() {
  std::array<char, 256> t{};  // every byte kInvalid unless listed below
  const auto set_both_cases = [&t](char upper, char to) {
    t[static_cast<unsigned char>(upper)] = to;
    t[static_cast<unsigned char>(upper - 'A' + 'a')] = to;
  };
  for (char c : std::string_view("ACGT")) set_both_cases(c, c);
  set_both_cases('U', 'T');
  for (char c : std::string_view("RYSWKMBDHVN")) set_both_cases(c, 'N');
  for (char c : std::string_view(" \t\r\v\f")) t[static_cast<unsigned char>(c)] = kSkip;
  return t;
}
constexpr std::array<char, 256> kBaseTable = make_base_table();

constexpr std::string_view kSpace = " \t\r\v\f";

// A byte as the user should see it in a message: printable ones quoted, the rest (binary junk, a file that is not
// FASTA at all) as an escape so the message stays one readable line.
std::string quote_char(char c) {
  const auto u = static_cast<unsigned char>(c);
  if (u >= 0x20 && u < 0x7f) return std::string{'\'', c, '\''};
  char buf[8];
  std::snprintf(buf, sizeof buf, "'\\x%02x'", u);
  return buf;
}

std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(kSpace);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(kSpace) - b + 1);
}

struct BgzfCloser {
  void operator()(BGZF* fp) const noexcept { bgzf_close(fp); }
};

// kstring_t owns a malloc'd buffer; this frees it however read_fasta exits.
struct LineBuffer {
  kstring_t s = KS_INITIALIZE;
  LineBuffer() = default;
  LineBuffer(const LineBuffer&) = delete;
  LineBuffer& operator=(const LineBuffer&) = delete;
  ~LineBuffer() { ks_free(&s); }
};

}  // namespace

std::vector<FastaRecord> read_fasta(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  require(fs::exists(st), path, "FASTA file does not exist");
  require(!fs::is_directory(st), path, "is a directory, not a FASTA file");

  errno = 0;
  const std::unique_ptr<BGZF, BgzfCloser> fp(bgzf_open(path.c_str(), "r"));
  require(fp != nullptr, path, "cannot open FASTA file: ", std::strerror(errno ? errno : EIO));

  // The first record is reserved from the file size so a one-chromosome genome is filled without reallocating:
  // exactly for plain text, and for gzip assuming ~3x compression (DNA packs to at most 4x), under rather than
  // over so as not to waste memory.
  const std::uintmax_t file_size = fs::file_size(path, ec);
  const std::size_t expansion = bgzf_compression(fp.get()) == no_compression ? 1 : 3;
  const std::size_t size_hint = ec ? 0 : std::size_t(file_size) * expansion;

  std::vector<FastaRecord> records;
  std::unordered_map<std::string, std::size_t> header_line;  // record name -> line of its header
  std::size_t lineno = 0, record_line = 0;
  const auto at = [&path](std::size_t line) { return path + ":" + std::to_string(line); };

  const auto finish_record = [&]() {
    if (records.empty()) return;
    std::string& seq = records.back().seq;
    require(!seq.empty(), at(record_line), "record '", records.back().name, "' has no sequence");
    // Geometric growth (and the size hint) can leave up to half the capacity unused; give it back when it matters.
    if (seq.capacity() - seq.size() > seq.capacity() / 8) seq.shrink_to_fit();
  };

  LineBuffer line;
  int n = 0;
  while ((n = bgzf_getline(fp.get(), '\n', &line.s)) >= 0) {
    ++lineno;
    if (n == 0) continue;
    const std::string_view text(line.s.s, std::size_t(n));

    if (text.front() == '>') {
      finish_record();
      const std::string_view header = text.substr(1);
      const std::size_t name_end = std::min(header.find_first_of(kSpace), header.size());
      const std::string_view name = header.substr(0, name_end);
      require(!name.empty(), at(lineno), "FASTA header has no name (expected '>name description')");
      const auto [prev, inserted] = header_line.try_emplace(std::string(name), lineno);
      require(inserted, at(lineno), "duplicate record name '", name, "' (first defined at line ", prev->second, ")");
      records.push_back({std::string(name), std::string(trim(header.substr(name_end))), {}});
      if (records.size() == 1) records.back().seq.reserve(size_hint);
      record_line = lineno;
      continue;
    }

    if (records.empty()) {
      require(trim(text).empty(), at(lineno), "sequence data before the first '>' header (is this a FASTA file?)");
      continue;
    }

    // Write straight into the record: resize grows geometrically, then the pointer walk drops skipped bytes.
    std::string& seq = records.back().seq;
    const std::size_t old_size = seq.size();
    seq.resize(old_size + text.size());
    char* out = seq.data() + old_size;
    for (std::size_t i = 0; i < text.size(); ++i) {
      const char base = kBaseTable[static_cast<unsigned char>(text[i])];
      if (base > kSkip) {
        *out++ = base;
      } else if (base == kInvalid) {
        throw Error(at(lineno), detail::concat("invalid character ", quote_char(text[i]), " at line ", lineno,
                                               ", column ", i + 1, " of record '", records.back().name,
                                               "' (expected a nucleotide code: ACGTU or IUPAC RYSWKMBDHVN)"));
      }
    }
    seq.resize(std::size_t(out - seq.data()));
  }
  require(n == -1, at(lineno + 1), "read error (truncated or corrupt compressed data?)");
  require(lineno > 0, path, "FASTA file is empty");
  require(!records.empty(), path, "no FASTA records (no line starts with '>')");
  finish_record();
  return records;
}

}  // namespace mm::io
