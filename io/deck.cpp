#include "io/deck.hpp"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "core/error.hpp"

namespace po = boost::program_options;

namespace mm::io {

namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

// Shortest text that reads back as the same double.
std::string format_double(double v) {
  for (int prec = 6; prec <= 17; ++prec) {
    std::ostringstream os;
    os.precision(prec);
    os << v;
    if (std::stod(os.str()) == v || prec == 17) return os.str();
  }
  return std::to_string(v);
}

std::string to_text(bool v) { return v ? "true" : "false"; }
std::string to_text(std::int64_t v) { return std::to_string(v); }
std::string to_text(double v) { return format_double(v); }
std::string to_text(const std::string& v) { return v; }

template <class T>
const char* type_name();
template <>
const char* type_name<bool>() { return "a boolean (true/false)"; }
template <>
const char* type_name<std::int64_t>() { return "an integer"; }
template <>
const char* type_name<double>() { return "a number"; }
template <>
const char* type_name<std::string>() { return "a string"; }

// Reads the deck's lines: "[section]" headers, "key = value" entries, comments (# or ;) and blanks. Anything else
// is a syntax error naming the file and line.
std::vector<DeckLine> scan(std::istream& in, const std::string& path) {
  std::vector<DeckLine> out;
  std::string line, section;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    const auto hash = line.find('#');
    std::string s = trim(hash == std::string::npos ? line : line.substr(0, hash));
    if (s.empty()) continue;
    const std::string where = path + ":" + std::to_string(number);
    if (s.front() == '[') {
      require(s.back() == ']' && s.size() > 2, where, "malformed section header '", s, "' (expected [name])");
      section = trim(s.substr(1, s.size() - 2));
      continue;
    }
    const auto eq = s.find('=');
    require(eq != std::string::npos, where, "expected 'key = value' or '[section]', got '", s, "'");
    const std::string key = trim(s.substr(0, eq));
    require(!key.empty(), where, "missing key before '='");
    out.push_back({number, section.empty() ? key : section + "." + key, trim(s.substr(eq + 1))});
  }
  return out;
}

std::vector<DeckLine> scan(const std::string& path) {
  std::ifstream in(path);
  require(bool(in), path, "cannot open the deck file");
  return scan(in, path);
}

std::pair<std::string, std::string> split_override(const std::string& arg) {
  std::string s = arg;
  while (!s.empty() && s.front() == '-') s.erase(s.begin());
  const auto eq = s.find('=');
  require(eq != std::string::npos && eq > 0, "command line", "override '", arg,
          "' is not of the form --section.key=value");
  return {trim(s.substr(0, eq)), trim(s.substr(eq + 1))};
}

}  // namespace

Deck::Deck() : desc_("deck options") {}

template <class T>
Deck& Deck::add(const std::string& key, const T& default_value, const std::string& help) {
  const auto dot = key.find('.');
  require(dot != std::string::npos && dot > 0 && dot + 1 < key.size(), "deck", "option '", key,
          "' must be named section.key");
  require(!declared_.count(key), "deck", "option '", key, "' declared twice");
  desc_.add_options()(key.c_str(), po::value<T>()->default_value(default_value, to_text(default_value)),
                      help.c_str());
  declared_[key] = Decl{key.substr(0, dot), key.substr(dot + 1), help, to_text(default_value), type_name<T>()};
  order_.push_back(key);
  return *this;
}

template Deck& Deck::add<bool>(const std::string&, const bool&, const std::string&);
template Deck& Deck::add<std::int64_t>(const std::string&, const std::int64_t&, const std::string&);
template Deck& Deck::add<double>(const std::string&, const double&, const std::string&);
template Deck& Deck::add<std::string>(const std::string&, const std::string&, const std::string&);

std::vector<std::string> Deck::sections() const {
  std::vector<std::string> out;
  for (const auto& k : order_) {
    const auto& s = declared_.at(k).section;
    if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  }
  return out;
}

std::vector<std::string> Deck::keys_in(const std::string& section) const {
  std::vector<std::string> out;
  for (const auto& k : order_)
    if (declared_.at(k).section == section) out.push_back(declared_.at(k).name);
  return out;
}

void Deck::check_key(const std::string& key, const std::string& where) const {
  if (declared_.count(key)) return;
  const auto dot = key.find('.');
  const std::string section = dot == std::string::npos ? "" : key.substr(0, dot);
  std::ostringstream msg;
  const auto keys = keys_in(section);
  if (keys.empty()) {
    msg << "unknown section '" << (section.empty() ? key : section) << "'; valid sections:";
    for (const auto& s : sections()) msg << " [" << s << "]";
  } else {
    msg << "unknown key '" << key.substr(dot + 1) << "' in [" << section << "]; valid keys:";
    for (const auto& k : keys) msg << " " << k;
  }
  throw Error(where, msg.str());
}

void Deck::value_error(const std::string& key, const std::string& value, const std::string& type,
                       const std::string& where) const {
  throw Error(where, "value '" + value + "' of " + key + " is not " + type);
}

void Deck::parse(const std::string& path, const std::vector<std::string>& overrides) {
  if (path.empty()) return parse_lines({}, "", overrides);
  parse_lines(scan(path), path, overrides);
}

void Deck::parse_text(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  parse_lines(scan(in, name), name, {});
}

void Deck::parse_lines(std::vector<DeckLine> lines, const std::string& path, const std::vector<std::string>& overrides) {
  path_ = path;
  // Command-line overrides are stored first: Boost.Program_options keeps the first value stored for a key.
  std::ostringstream cli;
  std::set<std::string> seen;
  for (const auto& o : overrides) {
    const auto [key, value] = split_override(o);
    check_key(key, "command line");
    require(seen.insert(key).second, "command line", "option --", key, " given twice");
    cli << key << "=" << value << "\n";
    where_[key] = "command line (--" + key + ")";
  }
  {
    std::set<std::string> in_file;
    for (const auto& l : lines) {
      const std::string where = path + ":" + std::to_string(l.number);
      check_key(l.key, where);
      require(in_file.insert(l.key).second, where, "key '", l.key, "' given twice in the deck");
      if (!where_.count(l.key)) where_[l.key] = where;
    }
  }
  auto store_text = [&](const std::string& text) {
    std::istringstream is(text);
    po::store(po::parse_config_file(is, desc_, false), vm_);
  };
  auto rethrow = [&](const po::error& e, const std::string& key) {
    const auto it = declared_.find(key);
    std::string value;
    for (const auto& l : lines)
      if (l.key == key) value = l.value;
    for (const auto& o : overrides)
      if (split_override(o).first == key) value = split_override(o).second;
    if (it != declared_.end())
      value_error(key, value, it->second.type, where_.count(key) ? where_.at(key) : path);
    throw Error(path, e.what());
  };
  // Store the overrides, then the file's entries one by one so that a bad value is reported with its line.
  std::string current;
  try {
    std::istringstream cli_lines(cli.str());
    std::string kv;
    while (std::getline(cli_lines, kv)) {
      current = kv.substr(0, kv.find('='));
      store_text(kv + "\n");
    }
    for (const auto& l : lines) {
      if (where_.at(l.key).rfind("command line", 0) == 0) continue;
      current = l.key;
      store_text(l.key + "=" + l.value + "\n");
    }
    current.clear();
    po::notify(vm_);
  } catch (const po::error& e) {
    rethrow(e, current);
  }
}

template <class T>
T Deck::get(const std::string& key) const {
  require(declared_.count(key), "deck", "option '", key, "' was never declared");
  try {
    return vm_.at(key).as<T>();
  } catch (const std::exception&) {
    throw Error("deck", "option '" + key + "' read with the wrong type (it is " + declared_.at(key).type + ")");
  }
}

template bool Deck::get<bool>(const std::string&) const;
template std::int64_t Deck::get<std::int64_t>(const std::string&) const;
template double Deck::get<double>(const std::string&) const;
template std::string Deck::get<std::string>(const std::string&) const;

bool Deck::defaulted(const std::string& key) const {
  const auto it = vm_.find(key);
  return it == vm_.end() || it->second.defaulted();
}

std::string Deck::render(bool with_help) const {
  std::ostringstream os;
  for (const auto& s : sections()) {
    os << "[" << s << "]\n";
    for (const auto& k : order_) {
      const Decl& d = declared_.at(k);
      if (d.section != s) continue;
      if (with_help) {
        os << "  " << d.name << " = " << d.default_text << "\n      " << d.help << "\n";
        continue;
      }
      const auto& v = vm_.at(k).value();
      std::string text;
      if (const auto* b = boost::any_cast<bool>(&v)) text = to_text(*b);
      else if (const auto* i = boost::any_cast<std::int64_t>(&v)) text = to_text(*i);
      else if (const auto* x = boost::any_cast<double>(&v)) text = to_text(*x);
      else if (const auto* str = boost::any_cast<std::string>(&v)) text = *str;
      os << d.name << " = " << text << (defaulted(k) ? "    # default" : "") << "\n";
    }
    if (!with_help) os << "\n";
  }
  return os.str();
}

std::string peek(const std::string& path, const std::vector<std::string>& overrides, const std::string& key,
                 const std::string& fallback) {
  for (const auto& o : overrides) {
    const auto [k, v] = split_override(o);
    if (k == key) return v;
  }
  if (path.empty()) return fallback;
  for (const auto& l : scan(path))
    if (l.key == key) return l.value;
  return fallback;
}

}  // namespace mm::io

namespace mm::io {
std::string peek_text(const std::string& text, const std::string& key, const std::string& fallback) {
  std::istringstream in(text);
  for (const auto& l : scan(in, "deck text"))
    if (l.key == key) return l.value;
  return fallback;
}
}  // namespace mm::io
