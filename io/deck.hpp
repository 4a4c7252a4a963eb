// Input decks: Boost.Program_options config files
//
//   [section]
//   key = value      # comment (from '#' to the end of the line)
//
// with command-line overrides `--section.key=value`. Every option is declared with a type, a default and a help
// text; an unknown section or key (in the file or on the command line) is an error that names the file and line
// and lists the valid keys; a value that does not parse is an error naming the key. The effective deck (every key,
// with the defaults filled in) can be echoed and stored in checkpoints.
#pragma once

#include <boost/program_options.hpp>
#include <map>
#include <string>
#include <vector>

namespace mm::io {

// One "key = value" line of a deck, key as section.key.
struct DeckLine {
  int number;
  std::string key, value;
};

class Deck {
 public:
  Deck();

  // Declare an option "section.key". T: bool, std::int64_t, double or std::string.
  template <class T>
  Deck& add(const std::string& key, const T& default_value, const std::string& help);

  // Read `path` (may be empty: defaults only), then apply `overrides` of the form "--section.key=value"
  // (the leading dashes are optional). Overrides win over the file.
  void parse(const std::string& path, const std::vector<std::string>& overrides);
  // Parse deck text held in memory (e.g. the deck stored in a checkpoint); `name` stands for the file in errors.
  void parse_text(const std::string& text, const std::string& name);

  template <class T>
  T get(const std::string& key) const;
  bool defaulted(const std::string& key) const;
  bool has(const std::string& key) const { return declared_.count(key) > 0; }

  // The effective deck as config-file text, sections in declaration order; defaulted keys are marked.
  std::string effective() const { return render(false); }
  // Help text: every section and key with its default and description.
  std::string help() const { return render(true); }
  const std::string& path() const { return path_; }

 private:
  void parse_lines(std::vector<DeckLine> lines, const std::string& path, const std::vector<std::string>& overrides);
  struct Decl {
    std::string section, name, help, default_text, type;
  };
  std::string render(bool with_help) const;
  std::vector<std::string> keys_in(const std::string& section) const;
  std::vector<std::string> sections() const;
  void check_key(const std::string& key, const std::string& where) const;
  [[noreturn]] void value_error(const std::string& key, const std::string& value, const std::string& type,
                                const std::string& where) const;

  boost::program_options::options_description desc_;
  boost::program_options::variables_map vm_;
  std::vector<std::string> order_;
  std::map<std::string, Decl> declared_;
  std::map<std::string, std::string> where_;  // key -> "file:line" or "command line"
  std::string path_;
};

// Peek at one key of a deck file without declaring anything (used to pick the driver before its options are
// known). Returns `fallback` when the file or the key is absent; overrides are consulted first.
std::string peek(const std::string& path, const std::vector<std::string>& overrides, const std::string& key,
                 const std::string& fallback);

// The same for deck text held in memory.
std::string peek_text(const std::string& text, const std::string& key, const std::string& fallback);

}  // namespace mm::io
