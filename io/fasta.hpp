// FASTA input for the genomics models. Sequences are normalised on the way in so that everything downstream
// (io/tokens.hpp, the samplers) only ever sees the five letters A, C, G, T and N.
#pragma once

#include <string>
#include <vector>

namespace mm::io {

struct FastaRecord {
  std::string name;         // header up to the first whitespace; unique within a file
  std::string description;  // rest of the header, surrounding whitespace trimmed
  std::string seq;          // upper case A/C/G/T/N only
};

// Reads every record of a FASTA file: plain text, gzip or bgzip, told apart by the content (not the file name)
// through htslib's BGZF reader. Sequence letters are upper-cased; A C G T are kept, U becomes T and the other
// IUPAC codes (R Y S W K M B D H V N) become N. Whitespace, including the '\r' of CRLF files, is ignored.
// Throws mm::Error with context `path` or `path:line` when the file is missing or unreadable, empty or holds no
// records, has sequence before the first header, a header without a name, a record without sequence, a character
// that is not a nucleotide code, or two records of the same name.
std::vector<FastaRecord> read_fasta(const std::string& path);

}  // namespace mm::io
