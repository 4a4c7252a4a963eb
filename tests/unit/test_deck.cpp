// Input decks: sections, types, command-line overrides, and errors that name the file, line and key.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "catch.hpp"
#include "core/error.hpp"
#include "io/deck.hpp"

using mm::io::Deck;
using I = std::int64_t;

namespace {

std::string write_deck(const std::string& name, const std::string& text) {
  const auto dir = std::filesystem::temp_directory_path() / ("mambamoe_deck_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto p = (dir / name).string();
  std::ofstream(p) << text;
  return p;
}

Deck declared() {
  Deck d;
  d.add<std::string>("run.driver", "genomics_lm", "driver")
      .add<I>("train.steps", 100, "steps")
      .add<double>("train.lr", 1e-3, "lr")
      .add<bool>("model.tie_embeddings", true, "tie")
      .add<I>("model.d_model", 64, "width");
  return d;
}

}  // namespace

TEST_CASE("deck: values from the file, defaults, and command-line overrides", "[deck]") {
  const auto p = write_deck("ok.in",
                            "# comment\n[run]\ndriver = genomics_lm\n\n[train]\nsteps = 250   # trailing comment\n"
                            "lr = 3e-4\n[model]\ntie_embeddings = false\n");
  Deck d = declared();
  d.parse(p, {"--train.steps=7", "model.d_model=32"});
  CHECK(d.get<std::string>("run.driver") == "genomics_lm");
  CHECK(d.get<I>("train.steps") == 7);  // the override wins over the file
  CHECK(d.get<double>("train.lr") == 3e-4);
  CHECK(d.get<bool>("model.tie_embeddings") == false);
  CHECK(d.get<I>("model.d_model") == 32);
  CHECK_FALSE(d.defaulted("train.lr"));
  // The effective deck parses back to the same values.
  const auto e = write_deck("effective.in", d.effective());
  Deck d2 = declared();
  d2.parse(e, {});
  CHECK(d2.get<I>("train.steps") == 7);
  CHECK(d2.get<double>("train.lr") == 3e-4);
  CHECK(d2.get<bool>("model.tie_embeddings") == false);
  CHECK(d2.get<I>("model.d_model") == 32);
  CHECK_THAT(d.effective(), ContainsSubstring("[train]"));
  CHECK_THAT(d.help(), ContainsSubstring("d_model = 64"));
}

TEST_CASE("deck: unknown keys and sections are errors naming the file, line and the valid keys", "[deck]") {
  const auto p = write_deck("unknown.in", "[train]\nsteps = 5\nstepz = 6\n");
  Deck d = declared();
  CHECK_THROWS_WITH(d.parse(p, {}), ContainsSubstring(p + ":3") && ContainsSubstring("unknown key 'stepz'") &&
                                        ContainsSubstring("valid keys: steps lr"));
  const auto q = write_deck("section.in", "[trian]\nsteps = 5\n");
  Deck d2 = declared();
  CHECK_THROWS_WITH(d2.parse(q, {}), ContainsSubstring(q + ":2") && ContainsSubstring("unknown section 'trian'") &&
                                         ContainsSubstring("[train]"));
  Deck d3 = declared();
  CHECK_THROWS_WITH(d3.parse("", {"--train.sTeps=3"}),
                    ContainsSubstring("command line") && ContainsSubstring("unknown key 'sTeps'"));
}

TEST_CASE("deck: bad values, duplicates, malformed lines and missing files", "[deck]") {
  Deck d = declared();
  const auto bad = write_deck("badvalue.in", "[train]\nsteps = ten\n");
  CHECK_THROWS_WITH(d.parse(bad, {}), ContainsSubstring(bad + ":2") && ContainsSubstring("train.steps") &&
                                          ContainsSubstring("not an integer"));
  Deck d2 = declared();
  CHECK_THROWS_WITH(d2.parse("", {"--train.lr=fast"}),
                    ContainsSubstring("--train.lr") && ContainsSubstring("not a number"));
  Deck d3 = declared();
  const auto dup = write_deck("dup.in", "[train]\nsteps = 1\nsteps = 2\n");
  CHECK_THROWS_WITH(d3.parse(dup, {}), ContainsSubstring(dup + ":3") && ContainsSubstring("given twice"));
  Deck d4 = declared();
  const auto mal = write_deck("malformed.in", "[train]\nsteps 5\n");
  CHECK_THROWS_WITH(d4.parse(mal, {}), ContainsSubstring(mal + ":2") && ContainsSubstring("key = value"));
  Deck d5 = declared();
  CHECK_THROWS_WITH(d5.parse("/nonexistent/deck.in", {}), ContainsSubstring("/nonexistent/deck.in") &&
                                                               ContainsSubstring("cannot open"));
  Deck d6 = declared();
  CHECK_THROWS_WITH(d6.parse("", {"--train.steps"}), ContainsSubstring("--section.key=value"));
  CHECK(mm::io::peek(dup, {"--run.driver=x"}, "run.driver", "y") == "x");
  CHECK(mm::io::peek(dup, {}, "run.driver", "fallback") == "fallback");
}
