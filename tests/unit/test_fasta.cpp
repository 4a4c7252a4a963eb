// The FASTA reader (plain, gzip, bgzip; normalisation; every error naming the file and line), the shipped lambda
// phage genome, and the DNA token vocabulary.
#include <htslib/bgzf.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "files.hpp"
#include "core/error.hpp"
#include "io/fasta.hpp"
#include "io/tokens.hpp"

using mm::io::FastaRecord;
using mm::io::read_fasta;
namespace fs = std::filesystem;

using mmtest::TempDir;

namespace {

// Through htslib's writer so the test needs no external tool: mode "w" writes BGZF, "wg" plain gzip.
std::string write_compressed(const TempDir& dir, const std::string& name, const std::string& content,
                             const char* mode) {
  const std::string p = dir.file(name);
  BGZF* fp = bgzf_open(p.c_str(), mode);
  REQUIRE(fp != nullptr);
  REQUIRE(bgzf_write(fp, content.data(), content.size()) == ssize_t(content.size()));
  REQUIRE(bgzf_close(fp) == 0);
  return p;
}

// What htslib detects from the content: 0 plain, 1 gzip, 2 BGZF (htsCompression). Checked so that each test
// really exercises the reader path it is named after.
int compression_of(const std::string& path) {
  BGZF* fp = bgzf_open(path.c_str(), "r");
  REQUIRE(fp != nullptr);
  const int c = bgzf_compression(fp);
  bgzf_close(fp);
  return c;
}

// Several hundred kilobytes of 60-column sequence: spans many 64 KiB BGZF blocks, so lines cross block boundaries.
std::string large_fasta(std::string& seq0) {
  std::uint32_t state = 12345;
  seq0.clear();
  for (int i = 0; i < 300000; ++i) {
    state = state * 1664525u + 1013904223u;
    seq0 += "ACGT"[state >> 30];
  }
  std::string out = ">big a long one\n";
  for (std::size_t i = 0; i < seq0.size(); i += 60) out += seq0.substr(i, 60) + "\n";
  out += ">small\nacgtnACGTN\n";
  return out;
}

}  // namespace

TEST_CASE("read_fasta reads a plain multi-record file", "[io]") {
  TempDir dir;
  const auto p =
      dir.write("multi.fa", ">chr1 first chromosome, v2\nACGT\nTTGA\n\n>chr2\nGGCC\n>chr3  \tpadded  \nA\n");
  REQUIRE(compression_of(p) == 0);
  const std::vector<FastaRecord> r = read_fasta(p);
  REQUIRE(r.size() == 3);
  CHECK(r[0].name == "chr1");
  CHECK(r[0].description == "first chromosome, v2");
  CHECK(r[0].seq == "ACGTTTGA");
  CHECK(r[1].name == "chr2");
  CHECK(r[1].description.empty());
  CHECK(r[1].seq == "GGCC");
  CHECK(r[2].name == "chr3");
  CHECK(r[2].description == "padded");
  CHECK(r[2].seq == "A");
}

TEST_CASE("read_fasta upper-cases, maps IUPAC codes to N and U to T", "[io]") {
  TempDir dir;
  const auto p = dir.write("iupac.fa", ">x\nacgtACGT\nRYSWKMBDHVN\nryswkmbdhvn\nUuAc\n");
  const auto r = read_fasta(p);
  REQUIRE(r.size() == 1);
  CHECK(r[0].seq == "ACGTACGT" + std::string(22, 'N') + "TTAC");
}

TEST_CASE("read_fasta ignores CRLF line endings, blank lines and whitespace inside lines", "[io]") {
  TempDir dir;
  const auto p = dir.write("crlf.fa", "\r\n>r1 some text\r\nAC GT\t\r\n\r\nGG\r\n>r2\r\nT\r\n");
  const auto r = read_fasta(p);
  REQUIRE(r.size() == 2);
  CHECK(r[0].name == "r1");
  CHECK(r[0].description == "some text");
  CHECK(r[0].seq == "ACGTGG");
  CHECK(r[1].name == "r2");
  CHECK(r[1].seq == "T");
}

TEST_CASE("read_fasta gives the same records from plain, gzip and bgzip files", "[io]") {
  TempDir dir;
  std::string seq0;
  const std::string text = large_fasta(seq0);
  const auto plain = dir.write("big.fa", text);
  const auto gz = write_compressed(dir, "big.fa.gz", text, "wg");
  const auto bgz = write_compressed(dir, "big.bgz.fa.gz", text, "w");
  REQUIRE(compression_of(gz) == 1);
  REQUIRE(compression_of(bgz) == 2);
  // The name says nothing: a gzip file without .gz is still recognised from its content.
  const auto gz_no_suffix = write_compressed(dir, "big_gzip.fa", text, "wg");

  for (const auto& p : {plain, gz, bgz, gz_no_suffix}) {
    INFO(p);
    const auto r = read_fasta(p);
    REQUIRE(r.size() == 2);
    CHECK(r[0].name == "big");
    CHECK(r[0].description == "a long one");
    CHECK(r[0].seq == seq0);
    CHECK(r[1].name == "small");
    CHECK(r[1].seq == "ACGTNACGTN");
  }
}

TEST_CASE("read_fasta reads the shipped lambda phage genome", "[io]") {
  const fs::path p = fs::path(__FILE__).parent_path() / "../../inputs/genomics/data/lambda_virus.fa.gz";
  REQUIRE(fs::exists(p));
  const auto r = read_fasta(p.string());
  REQUIRE(r.size() == 1);
  CHECK(r[0].name == "gi|9626243|ref|NC_001416.1|");
  CHECK(r[0].description == "Enterobacteria phage lambda, complete genome");
  REQUIRE(r[0].seq.size() == 48502);
  std::size_t counts[256] = {};
  for (char c : r[0].seq) ++counts[static_cast<unsigned char>(c)];
  CHECK(counts['A'] == 12334);
  CHECK(counts['C'] == 11362);
  CHECK(counts['G'] == 12820);
  CHECK(counts['T'] == 11986);
  CHECK(r[0].seq.compare(0, 10, "GGGCGGCGAC") == 0);
}

TEST_CASE("read_fasta errors name the file, the line and the problem", "[io]") {
  // Both matchers inside the one assertion: Catch2 v2's combined matcher only points at its parts.
  TempDir dir;

  SECTION("sequence before the first header") {
    const auto p = dir.write("pre.fa", "\nACGT\n>r\nAC\n");
    CHECK_THROWS_WITH(read_fasta(p),
                      ContainsSubstring(p + ":2") && ContainsSubstring("sequence data before the first '>' header"));
  }
  SECTION("invalid character, quoted with line and column") {
    const auto p = dir.write("bad.fa", ">r\nACGT\nAC!T\n");
    CHECK_THROWS_WITH(read_fasta(p), ContainsSubstring(p + ":3") &&
                                         ContainsSubstring("invalid character '!' at line 3, column 3 of record 'r'"));
  }
  SECTION("invalid character inside a gzip file is located the same way") {
    const auto p = write_compressed(dir, "bad.fa.gz", ">r\nACGT\nACGT\nACG-\n", "wg");
    CHECK_THROWS_WITH(read_fasta(p),
                      ContainsSubstring(p + ":4") && ContainsSubstring("invalid character '-' at line 4, column 4"));
  }
  SECTION("non-printable character is escaped") {
    const auto p = dir.write("bin.fa", std::string(">r\nAC\x01T\n"));
    CHECK_THROWS_WITH(read_fasta(p), ContainsSubstring(p + ":2") && ContainsSubstring("invalid character '\\x01'"));
  }
  SECTION("empty file") {
    const auto p = dir.write("empty.fa", "");
    CHECK_THROWS_WITH(read_fasta(p), ContainsSubstring(p) && ContainsSubstring("empty"));
  }
  SECTION("only blank lines") {
    const auto p = dir.write("blank.fa", "\n \n\r\n");
    CHECK_THROWS_WITH(read_fasta(p), ContainsSubstring(p) && ContainsSubstring("no FASTA records"));
  }
  SECTION("header without sequence, in the middle and at the end") {
    const auto mid = dir.write("mid.fa", ">a\nAC\n>b desc\n>c\nGG\n");
    CHECK_THROWS_WITH(read_fasta(mid),
                      ContainsSubstring(mid + ":3") && ContainsSubstring("record 'b' has no sequence"));
    const auto end = dir.write("end.fa", ">a\nAC\n>b\n  \n");
    CHECK_THROWS_WITH(read_fasta(end),
                      ContainsSubstring(end + ":3") && ContainsSubstring("record 'b' has no sequence"));
  }
  SECTION("header without a name") {
    const auto bare = dir.write("bare.fa", ">\nACGT\n");
    CHECK_THROWS_WITH(read_fasta(bare), ContainsSubstring(bare + ":1") && ContainsSubstring("header has no name"));
    const auto spaced = dir.write("spaced.fa", ">a\nA\n> desc only\nACGT\n");
    CHECK_THROWS_WITH(read_fasta(spaced), ContainsSubstring(spaced + ":3") && ContainsSubstring("header has no name"));
  }
  SECTION("duplicate record names") {
    const auto p = dir.write("dup.fa", ">a x\nAC\n>b\nT\n>a y\nGG\n");
    CHECK_THROWS_WITH(read_fasta(p), ContainsSubstring(p + ":5") &&
                                         ContainsSubstring("duplicate record name 'a' (first defined at line 1)"));
  }
  SECTION("missing file and directory") {
    const std::string missing = dir.path() + "/nope.fa";
    CHECK_THROWS_WITH(read_fasta(missing), ContainsSubstring(missing) && ContainsSubstring("does not exist"));
    CHECK_THROWS_WITH(read_fasta(dir.path()), ContainsSubstring(dir.path()) && ContainsSubstring("is a directory"));
  }
  SECTION("errors are mm::Error with the location as context") {
    const auto p = dir.write("ctx.fa", ">r\nACGT\nAC!T\n");
    try {
      read_fasta(p);
      FAIL("no exception");
    } catch (const mm::Error& e) {
      CHECK(e.context() == p + ":3");
    }
  }
}

TEST_CASE("tokenize, token_to_base and complement_token", "[io]") {
  static_assert(mm::kNumTokens == 6 && mm::kPad == 0 && mm::kN == 5);
  static_assert(mm::base_to_token('G') == mm::kG && mm::complement_token(mm::kA) == mm::kT);

  CHECK(mm::tokenize("ACGTN") == std::vector<std::int32_t>{1, 2, 3, 4, 5});
  CHECK(mm::tokenize("").empty());
  // Only normalised input is expected: anything else is unknown.
  for (char c : std::string("acgtnX-*")) CHECK(mm::base_to_token(c) == mm::kN);

  std::string round;
  for (std::int32_t t : mm::tokenize("GATTACAN")) round += mm::token_to_base(t);
  CHECK(round == "GATTACAN");
  CHECK(mm::token_to_base(mm::kPad) == '-');

  CHECK(mm::complement_token(mm::kA) == mm::kT);
  CHECK(mm::complement_token(mm::kT) == mm::kA);
  CHECK(mm::complement_token(mm::kC) == mm::kG);
  CHECK(mm::complement_token(mm::kG) == mm::kC);
  CHECK(mm::complement_token(mm::kN) == mm::kN);
  CHECK(mm::complement_token(mm::kPad) == mm::kPad);
  for (std::int32_t t = 0; t < mm::kNumTokens; ++t) CHECK(mm::complement_token(mm::complement_token(t)) == t);
}
